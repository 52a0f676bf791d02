//! Data-parallel training of a small GPT under ZeRO stages 0–3, one thread
//! per rank, every tensor in the engine's buffers.
//!
//! Each rank executes the [`Plan`]: memory ops go to its
//! [`RankMemory`] (allocator + event tap), [`Exec`] ops run here: kernels of
//! [`model`] on operands read from the buffers (bf16 weights, activations and
//! gradients; fp32 statistics, gradient flow, logits, master weights and Adam
//! moments), collectives through a [`Communicator`].
//!
//! Determinism: micro-batch `j` of step `s` is a function of (seed, s, j);
//! rank `r` runs micro-batches `r·A … r·A+A−1` (A per rank). Every gradient
//! contribution is rounded to bf16, then summed in fp32 in micro-batch order
//! (a rank's accumulation buffer, then the collective's rank-order sum), and
//! the sum is rounded once into the bf16 gradient; AdamW is element-wise. So
//! stages 0–3, offload, and any rank count with the same micro-batches give
//! the same weights and losses, bit for bit.

pub mod adam;
pub mod data;
pub mod gemm;
pub mod model;
pub mod session;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::alloc::SharedAllocator;
use crate::comm::local::local_group;
use crate::comm::{CommError, Communicator};
use crate::device::Device;
use crate::model::{Arch, GptBlock, GptEmbed, GptFinal, Init, ModelSpec};
use crate::shard::engine::{EventTap, MemError, RankMemory};
use crate::shard::offload::HostStates;
use crate::shard::plan::{Act, Buf, Exec, Op, Plan, ZeroConfig};
use adam::AdamW;
use data::Markov;
use model::{round_bf16, Dims};
use GptBlock::*;

/// A training run's configuration.
#[derive(Debug, Clone)]
pub struct TrainConfig {
    /// The model (GPT architecture, bf16 with master weights).
    pub spec: ModelSpec,
    /// ZeRO stage, ranks, offload, micro-batches per step.
    pub zero: ZeroConfig,
    /// Training steps.
    pub steps: u64,
    /// Seed of the weights and the data.
    pub seed: u64,
    /// Optimizer.
    pub adam: AdamW,
    /// Timeout of every collective.
    pub comm_timeout: Duration,
    /// Fault injection for tests: rank `.0` panics at the start of step `.1`'s backward.
    pub panic_at: Option<(usize, u64)>,
}

impl TrainConfig {
    /// The memory plan of this configuration, or why it cannot be trained.
    pub fn plan(&self) -> Result<Plan, TrainError> {
        if self.spec.arch != Arch::Gpt2 || self.spec.heads != self.spec.kv_heads {
            return Err(TrainError::Config("the trainer runs GPT models (preset tiny or gpt2-124m)".into()));
        }
        Ok(Plan::new(&self.spec, self.zero)?)
    }

    /// Defaults for `spec` under `zero`.
    pub fn new(spec: ModelSpec, zero: ZeroConfig, steps: u64) -> Self {
        TrainConfig {
            spec,
            zero,
            steps,
            seed: 1,
            adam: AdamW::default(),
            comm_timeout: Duration::from_secs(60),
            panic_at: None,
        }
    }
}

/// Why a run failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TrainError {
    /// The configuration cannot be trained.
    #[error("invalid training configuration: {0}")]
    Config(String),
    /// The model and ZeRO configuration make no plan.
    #[error(transparent)]
    Plan(#[from] crate::shard::PlanError),
    /// A buffer operation failed.
    #[error(transparent)]
    Memory(#[from] MemError),
    /// A collective failed (another rank failed, left, or timed out).
    #[error("collective failed: {0}")]
    Comm(CommError),
    /// A rank's thread panicked.
    #[error("rank {rank} panicked: {message}")]
    Panicked {
        /// The rank.
        rank: usize,
        /// The panic message.
        message: String,
    },
    /// A step hook (e.g. a policy swap) failed.
    #[error("rank {rank}, step {step}: {message}")]
    Hook {
        /// The rank.
        rank: usize,
        /// The step.
        step: u64,
        /// What failed.
        message: String,
    },
}

impl From<CommError> for TrainError {
    fn from(e: CommError) -> Self {
        TrainError::Comm(e)
    }
}

/// One rank's figures after a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct RankStep {
    /// Device bytes of persistent model states (weights, gradients, optimizer states).
    pub model_state_bytes: u64,
    /// Most device bytes of layer buffers (gathered weights, full gradients) so far.
    pub layer_buffer_peak_bytes: u64,
    /// Host bytes of offloaded optimizer states.
    pub host_state_bytes: u64,
    /// Peak reserved device bytes so far.
    pub peak_reserved_bytes: u64,
    /// Reserved device bytes now.
    pub reserved_bytes: u64,
    /// Bytes this rank sent in collectives so far.
    pub comm_bytes: u64,
}

/// All ranks' figures after a step.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct StepReport {
    /// The step (0-based).
    pub step: u64,
    /// Mean loss over the step's micro-batches.
    pub loss: f64,
    /// Per rank.
    pub ranks: Vec<RankStep>,
}

/// A step hook: runs on every rank's thread at the start of every step, with
/// its allocator (e.g. a policy swap). An error stops the run.
pub type StepHook<D> = Arc<dyn Fn(usize, u64, &SharedAllocator<D>) -> Result<(), String> + Send + Sync>;

/// A report callback: called once per step with all ranks' figures, from the
/// rank that finishes the step last.
pub type ReportHook = Arc<dyn Fn(&StepReport) + Send + Sync>;

/// The result of a run.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TrainResult {
    /// Every step's report.
    pub steps: Vec<StepReport>,
    /// Parameters of the model (Ψ).
    pub parameters: u64,
}

/// A configured run over one allocator per rank.
pub struct Trainer<D: Device> {
    cfg: TrainConfig,
    plan: Plan,
    allocators: Vec<SharedAllocator<D>>,
    taps: Vec<Option<EventTap>>,
    on_step: Option<StepHook<D>>,
    on_report: Option<ReportHook>,
}

impl<D: Device + 'static> Trainer<D> {
    /// A run of `cfg` whose rank `r` allocates from `allocators[r]` (their
    /// devices must hold contents: a host-backed sim device or CUDA).
    pub fn new(cfg: TrainConfig, allocators: Vec<SharedAllocator<D>>) -> Result<Self, TrainError> {
        let plan = cfg.plan()?;
        if allocators.len() != cfg.zero.ranks {
            return Err(TrainError::Config(format!("{} allocators for {} ranks", allocators.len(), cfg.zero.ranks)));
        }
        let taps = (0..cfg.zero.ranks).map(|_| None).collect();
        Ok(Trainer { cfg, plan, allocators, taps, on_step: None, on_report: None })
    }

    /// The ranks' allocators (clones share them), e.g. for a control socket
    /// that swaps policies or reads statistics while the run goes on.
    pub fn allocators(&self) -> Vec<SharedAllocator<D>> {
        self.allocators.clone()
    }

    /// The memory plan.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Sends every allocation event of `rank` to `tap`.
    pub fn set_tap(&mut self, rank: usize, tap: EventTap) {
        if let Some(t) = self.taps.get_mut(rank) {
            *t = Some(tap);
        }
    }

    /// Runs `hook` on every rank at the start of every step.
    pub fn on_step(&mut self, hook: StepHook<D>) {
        self.on_step = Some(hook);
    }

    /// Calls `hook` with every step's report as soon as all ranks have finished it.
    pub fn on_report(&mut self, hook: ReportHook) {
        self.on_report = Some(hook);
    }

    /// Trains: one thread per rank. A rank that fails or panics makes every
    /// other rank's next collective fail, so the run ends with an error
    /// naming the first cause.
    pub fn run(self) -> Result<TrainResult, TrainError> {
        let Trainer { cfg, plan, allocators, taps, on_step, on_report } = self;
        let n = cfg.zero.ranks;
        let comms = local_group(n, cfg.comm_timeout);
        let reports = Arc::new(Mutex::new(Vec::<Vec<Option<RankStep>>>::new()));
        let losses = Arc::new(Mutex::new(Vec::<f64>::new()));
        let data = Arc::new(Markov::new(cfg.spec.vocab as u32, cfg.seed));
        let results: Vec<std::thread::Result<Result<(), TrainError>>> = std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .into_iter()
                .zip(allocators)
                .zip(taps)
                .enumerate()
                .map(|(rank, ((comm, alloc), tap))| {
                    let ctx = RankCtx {
                        cfg: &cfg,
                        plan: &plan,
                        data: data.clone(),
                        on_step: on_step.clone(),
                        on_report: on_report.clone(),
                        reports: reports.clone(),
                        losses: losses.clone(),
                    };
                    std::thread::Builder::new()
                        .name(format!("rank-{rank}"))
                        .spawn_scoped(s, move || {
                            let mem = RankMemory::new(rank, alloc, tap);
                            Rank::new(ctx, mem, Box::new(comm)).run()
                        })
                        .expect("spawning a rank thread")
                })
                .collect();
            handles.into_iter().map(|h| h.join()).collect()
        });
        // The first cause: a panic, else the first error that is not a
        // consequence of another rank's failure.
        let mut first: Option<TrainError> = None;
        for (rank, r) in results.into_iter().enumerate() {
            let e = match r {
                Ok(Ok(())) => continue,
                Ok(Err(e)) => e,
                Err(p) => {
                    let message = p
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_else(|| "unknown panic".into());
                    TrainError::Panicked { rank, message }
                }
            };
            let consequence = matches!(e, TrainError::Comm(CommError::GroupFailed { .. }));
            let better = match &first {
                None => true,
                Some(TrainError::Panicked { .. }) => false,
                Some(f) => {
                    matches!(e, TrainError::Panicked { .. })
                        || (!consequence && matches!(f, TrainError::Comm(CommError::GroupFailed { .. })))
                }
            };
            if better {
                first = Some(e);
            }
        }
        if let Some(e) = first {
            return Err(e);
        }
        let reports = std::mem::take(&mut *reports.lock().unwrap_or_else(|e| e.into_inner()));
        let losses = std::mem::take(&mut *losses.lock().unwrap_or_else(|e| e.into_inner()));
        let steps = reports
            .into_iter()
            .zip(losses)
            .enumerate()
            .map(|(s, (r, loss))| StepReport { step: s as u64, loss, ranks: r.into_iter().flatten().collect() })
            .collect();
        Ok(TrainResult { steps, parameters: plan.parameters() })
    }
}

/// Position of the output head in group `g` (the plan's head group): the
/// token embedding when tied (group 0), else the final group's head.
fn head_index(g: usize) -> usize {
    if g == 0 {
        GptEmbed::Tokens as usize
    } else {
        GptFinal::Head as usize
    }
}

/// What every rank shares.
struct RankCtx<'a, D: Device> {
    cfg: &'a TrainConfig,
    plan: &'a Plan,
    data: Arc<Markov>,
    on_step: Option<StepHook<D>>,
    on_report: Option<ReportHook>,
    reports: Arc<Mutex<Vec<Vec<Option<RankStep>>>>>,
    losses: Arc<Mutex<Vec<f64>>>,
}

/// One rank's state.
struct Rank<'a, D: Device> {
    ctx: RankCtx<'a, D>,
    mem: RankMemory<D>,
    comm: Box<dyn Communicator>,
    host: HostStates,
    dims: Dims,
    rank: usize,
    step: u64,
    /// Sum of this rank's micro-batch losses in the current step.
    loss_sum: f32,
    /// The current micro-batch's tokens and targets (host copy for the loss).
    offsets: Vec<Vec<u64>>,
}

impl<'a, D: Device> Rank<'a, D> {
    fn new(ctx: RankCtx<'a, D>, mem: RankMemory<D>, comm: Box<dyn Communicator>) -> Self {
        let s = &ctx.cfg.spec;
        let dims = Dims {
            batch: s.batch as usize,
            seq: s.seq as usize,
            hidden: s.hidden as usize,
            heads: s.heads as usize,
            inter: s.intermediate as usize,
            vocab: s.vocab as usize,
        };
        let offsets = ctx.plan.groups.iter().map(|g| g.offsets()).collect();
        let rank = comm.rank();
        Rank { ctx, mem, comm, host: HostStates::default(), dims, rank, step: 0, loss_sum: 0.0, offsets }
    }

    /// Element range of this rank's optimizer part of group `g`.
    fn optim_range(&self, g: usize) -> (u64, usize) {
        let n = self.ctx.plan.optim_elems(g);
        let at = if self.ctx.cfg.zero.stage >= 1 { self.rank as u64 * n } else { 0 };
        (at, n as usize)
    }

    /// Deterministic initial weights of group `g` (fp32, padded length).
    fn init_group(&self, g: usize) -> Vec<f32> {
        let plan = self.ctx.plan;
        let gr = &plan.groups[g];
        let mut rng = oorandom::Rand32::new(self.ctx.cfg.seed.wrapping_mul(31).wrapping_add(g as u64));
        let mut v = Vec::with_capacity(gr.padded as usize);
        let layers = plan.layers();
        let proj_scale = 1.0 / (2.0 * layers.max(1) as f32).sqrt();
        for (i, &n) in gr.tensors.iter().enumerate() {
            // The embeddings (group 0) are random; a block's and the final
            // group's tensors are initialized by their role in the layout.
            let init = if g == 0 {
                Init::Normal
            } else if g <= layers {
                GptBlock::ALL[i].init()
            } else {
                [GptFinal::NormWeight, GptFinal::NormBias, GptFinal::Head][i].init()
            };
            for _ in 0..n {
                v.push(match init {
                    Init::Ones => 1.0,
                    Init::Zeros => 0.0,
                    Init::Normal => (rng.rand_float() * 2.0 - 1.0) * 0.02 * 3f32.sqrt(),
                    Init::ResidualNormal => (rng.rand_float() * 2.0 - 1.0) * 0.02 * 3f32.sqrt() * proj_scale,
                });
            }
        }
        v.resize(gr.padded as usize, 0.0);
        v
    }

    fn run(mut self) -> Result<(), TrainError> {
        let plan = self.ctx.plan;
        for op in plan.setup() {
            self.mem.apply(&op)?;
        }
        // Initial states: weights, master weights, zero gradients and moments.
        for g in 0..plan.groups.len() {
            let full = self.init_group(g);
            let p_at = if plan.cfg.stage == 3 { self.rank * plan.param_elems(g) as usize } else { 0 };
            let p_n = plan.param_elems(g) as usize;
            self.mem.write_bf16(Buf::Param(g), 0, &full[p_at..p_at + p_n])?;
            self.mem.zero(Buf::Grad(g))?;
            let (at, n) = self.optim_range(g);
            let master = full[at as usize..at as usize + n].to_vec();
            if plan.cfg.offload {
                self.host.master.push(master);
                self.host.m.push(vec![0.0; n]);
                self.host.v.push(vec![0.0; n]);
            } else {
                self.mem.write_f32(Buf::Master(g), 0, &master)?;
                self.mem.zero(Buf::ExpAvg(g))?;
                self.mem.zero(Buf::ExpAvgSq(g))?;
            }
        }
        for step in 0..self.ctx.cfg.steps {
            self.step = step;
            self.loss_sum = 0.0;
            if let Some(h) = &self.ctx.on_step {
                h(self.rank, step, self.mem.allocator()).map_err(|message| TrainError::Hook {
                    rank: self.rank,
                    step,
                    message,
                })?;
            }
            for op in plan.step(step) {
                match op {
                    Op::Exec(e) => self.exec(e)?,
                    Op::Phase(crate::types::Phase::Backward, s) if self.ctx.cfg.panic_at == Some((self.rank, s)) => {
                        panic!("injected fault: rank {} panics in step {s}", self.rank)
                    }
                    Op::Alloc { buf, .. } => {
                        self.mem.apply(&op)?;
                        if matches!(buf, Buf::FullGrad(_)) {
                            self.mem.zero(buf)?;
                        }
                    }
                    _ => self.mem.apply(&op)?,
                }
            }
            let mut loss = [self.loss_sum];
            self.comm.all_reduce_sum(&mut loss)?;
            self.report(step, loss[0] as f64 / self.ctx.cfg.zero.micro_batches as f64);
        }
        Ok(())
    }

    fn report(&self, step: u64, loss: f64) {
        let (peak, reserved) =
            self.mem.allocator().with(|a| (a.gauges().peak_reserved_bytes, a.gauges().reserved_bytes));
        let me = RankStep {
            model_state_bytes: self.mem.state_live,
            layer_buffer_peak_bytes: self.mem.layer_peak,
            host_state_bytes: self.host.bytes(),
            peak_reserved_bytes: peak,
            reserved_bytes: reserved,
            comm_bytes: self.comm.bytes_sent(),
        };
        let n = self.ctx.cfg.zero.ranks;
        let complete = {
            let mut r = self.ctx.reports.lock().unwrap_or_else(|e| e.into_inner());
            while r.len() <= step as usize {
                r.push(vec![None; n]);
            }
            r[step as usize][self.rank] = Some(me);
            r[step as usize].iter().all(Option::is_some).then(|| r[step as usize].iter().flatten().copied().collect())
        };
        if self.rank == 0 {
            let mut l = self.ctx.losses.lock().unwrap_or_else(|e| e.into_inner());
            l.push(loss);
        }
        if let (Some(ranks), Some(h)) = (complete, &self.ctx.on_report) {
            h(&StepReport { step, loss, ranks });
        }
    }

    /// The f32 weights of group `g` for compute.
    fn weights(&self, g: usize) -> Result<Vec<f32>, TrainError> {
        let n = self.ctx.plan.groups[g].padded as usize;
        Ok(self.mem.read_bf16(self.ctx.plan.weights(g), 0, n)?)
    }

    /// Tensor `i` (its position in the group's layout) of group `g`'s weights `w`.
    fn tensor<'w>(&self, w: &'w [f32], g: usize, i: usize) -> &'w [f32] {
        let at = self.offsets[g][i] as usize;
        &w[at..at + self.ctx.plan.groups[g].tensors[i] as usize]
    }

    fn exec(&mut self, e: Exec) -> Result<(), TrainError> {
        let plan = self.ctx.plan;
        let d = self.dims;
        let (t, h, v) = (d.tokens(), d.hidden, d.vocab);
        let last = plan.layers() + 1;
        match e {
            Exec::LoadBatch(k) => {
                let j = (self.rank * plan.cfg.local_micro_batches() + k) as u64;
                let (x, y) = self.ctx.data.batch(self.step, j, d.batch, d.seq);
                self.mem.write_u32(Buf::Tokens, 0, &x)?;
                self.mem.write_u32(Buf::Tokens, t as u64, &y)?;
            }
            Exec::Gather(g) => {
                let n = plan.param_elems(g) as usize;
                let shard = self.mem.read_bf16(Buf::Param(g), 0, n)?;
                let mut full = vec![0.0; n * plan.cfg.ranks];
                self.comm.all_gather(&shard, &mut full)?;
                self.mem.write_bf16(Buf::Gathered(g), 0, &full)?;
            }
            Exec::EmbedFwd => {
                let w = self.weights(0)?;
                let (wte, wpe) =
                    (self.tensor(&w, 0, GptEmbed::Tokens as usize), self.tensor(&w, 0, GptEmbed::Positions as usize));
                let x = self.mem.read_u32(Buf::Tokens, 0, t)?;
                let mut out = vec![0.0; t * h];
                for (i, &tok) in x.iter().enumerate() {
                    let pos = i % d.seq;
                    for c in 0..h {
                        out[i * h + c] = wte[tok as usize * h + c] + wpe[pos * h + c];
                    }
                }
                self.mem.write_bf16(Buf::Hidden(0), 0, &out)?;
            }
            Exec::BlockFwd(l) => self.block_fwd(l)?,
            Exec::BlockBwd(l) => self.block_bwd(l)?,
            Exec::FinalFwd => {
                let w = self.weights(last)?;
                let x = self.mem.read_bf16(Buf::Hidden(last - 1), 0, t * h)?;
                let (g, b) = (GptFinal::NormWeight as usize, GptFinal::NormBias as usize);
                let (mut y, mean, rstd) = model::layernorm(&x, self.tensor(&w, last, g), self.tensor(&w, last, b), h);
                round_bf16(&mut y);
                self.mem.write_bf16(Buf::Normed, 0, &y)?;
                self.mem.write_f32(Buf::NormedMean, 0, &mean)?;
                self.mem.write_f32(Buf::NormedRstd, 0, &rstd)?;
            }
            Exec::HeadLoss => {
                let hg = plan.head_group();
                let w = self.weights(hg)?;
                let head = self.tensor(&w, hg, head_index(hg));
                let x = self.mem.read_bf16(Buf::Normed, 0, t * h)?;
                let mut logits = vec![0.0; t * v];
                gemm::matmul(&x, false, head, true, &mut logits, t, h, v, 0.0);
                let y = self.mem.read_u32(Buf::Tokens, t as u64, t)?;
                let loss = model::cross_entropy(&mut logits, &y, v);
                self.loss_sum += loss;
                self.mem.write_f32(Buf::Logits, 0, &logits)?;
            }
            Exec::HeadBwd => {
                let hg = plan.head_group();
                let w = self.weights(hg)?;
                let ti = head_index(hg);
                let head = self.tensor(&w, hg, ti);
                let dl = self.mem.read_f32(Buf::Logits, 0, t * v)?;
                let x = self.mem.read_bf16(Buf::Normed, 0, t * h)?;
                let mut dw = vec![0.0; v * h];
                gemm::matmul(&dl, true, &x, false, &mut dw, v, t, h, 0.0);
                let mut dx = vec![0.0; t * h];
                gemm::matmul(&dl, false, head, false, &mut dx, t, v, h, 0.0);
                self.mem.write_f32(Buf::DNormed, 0, &dx)?;
                if hg == 0 {
                    // The whole group: the head's share of the tied embedding, zero elsewhere.
                    let mut full = vec![0.0; plan.groups[0].padded as usize];
                    full[..v * h].copy_from_slice(&dw);
                    self.mem.write_bf16(plan.grad_full(0), 0, &full)?;
                } else {
                    self.mem.write_bf16(plan.grad_full(hg), self.offsets[hg][ti], &dw)?;
                }
            }
            Exec::FinalBwd => {
                let w = self.weights(last)?;
                let dy = self.mem.read_f32(Buf::DNormed, 0, t * h)?;
                let x = self.mem.read_bf16(Buf::Hidden(last - 1), 0, t * h)?;
                let mean = self.mem.read_f32(Buf::NormedMean, 0, t)?;
                let rstd = self.mem.read_f32(Buf::NormedRstd, 0, t)?;
                let mut dgb = vec![0.0; 2 * h];
                let (dg, db) = dgb.split_at_mut(h);
                let gamma = self.tensor(&w, last, GptFinal::NormWeight as usize);
                let dx = model::layernorm_bwd(&dy, &x, &mean, &rstd, gamma, dg, db);
                self.mem.write_f32(Buf::DHidden(last - 1), 0, &dx)?;
                self.mem.write_bf16(plan.grad_full(last), 0, &dgb)?;
            }
            Exec::EmbedBwd => {
                let dx = self.mem.read_f32(Buf::DHidden(0), 0, t * h)?;
                let x = self.mem.read_u32(Buf::Tokens, 0, t)?;
                let n = plan.groups[0].padded as usize;
                let mut g =
                    if plan.head_group() == 0 { self.mem.read_bf16(plan.grad_full(0), 0, n)? } else { vec![0.0; n] };
                let wpe_at = self.offsets[0][GptEmbed::Positions as usize] as usize;
                for (i, &tok) in x.iter().enumerate() {
                    let pos = i % d.seq;
                    for c in 0..h {
                        g[tok as usize * h + c] += dx[i * h + c];
                        g[wpe_at + pos * h + c] += dx[i * h + c];
                    }
                }
                self.mem.write_bf16(plan.grad_full(0), 0, &g)?;
            }
            Exec::Accumulate { group, first } => {
                let n = plan.groups[group].padded as usize;
                let x = self.mem.read_bf16(plan.grad_full(group), 0, n)?;
                let acc = if first {
                    x
                } else {
                    let mut a = self.mem.read_f32(Buf::Acc(group), 0, n)?;
                    a.iter_mut().zip(&x).for_each(|(a, b)| *a += b);
                    a
                };
                self.mem.write_f32(Buf::Acc(group), 0, &acc)?;
            }
            Exec::Reduce(g) => {
                let n = plan.groups[g].padded as usize;
                let mut full = if plan.cfg.local_micro_batches() > 1 {
                    self.mem.read_f32(Buf::Acc(g), 0, n)?
                } else {
                    self.mem.read_bf16(plan.grad_full(g), 0, n)?
                };
                if plan.cfg.stage <= 1 {
                    self.comm.all_reduce_sum(&mut full)?;
                    self.mem.write_bf16(Buf::Grad(g), 0, &full)?;
                } else {
                    let mut shard = vec![0.0; plan.grad_elems(g) as usize];
                    self.comm.reduce_scatter_sum(&full, &mut shard)?;
                    self.mem.write_bf16(Buf::Grad(g), 0, &shard)?;
                }
            }
            Exec::Adam(g) => self.adam(g)?,
            Exec::GatherUpdated(g) => {
                let (at, n) = self.optim_range(g);
                let mine = self.mem.read_bf16(Buf::Param(g), at, n)?;
                let mut full = vec![0.0; n * plan.cfg.ranks];
                self.comm.all_gather(&mine, &mut full)?;
                self.mem.write_bf16(Buf::Param(g), 0, &full)?;
            }
        }
        Ok(())
    }

    fn adam(&mut self, g: usize) -> Result<(), TrainError> {
        let plan = self.ctx.plan;
        let (at, n) = self.optim_range(g);
        // Gradients of this rank's part: the shard of a full buffer (stage 1)
        // or the whole buffer (stage 0: everything; stages 2–3: the shard).
        let grad_at = if plan.cfg.stage == 1 { at } else { 0 };
        let grad = self.mem.read_bf16(Buf::Grad(g), grad_at, n)?;
        let scale = 1.0 / plan.cfg.micro_batches as f32;
        let t = self.step + 1;
        let master = if plan.cfg.offload {
            let (p, m, v) = (&mut self.host.master[g], &mut self.host.m[g], &mut self.host.v[g]);
            self.ctx.cfg.adam.step(t, p, m, v, &grad, scale);
            p.clone()
        } else {
            let mut p = self.mem.read_f32(Buf::Master(g), 0, n)?;
            let mut m = self.mem.read_f32(Buf::ExpAvg(g), 0, n)?;
            let mut v = self.mem.read_f32(Buf::ExpAvgSq(g), 0, n)?;
            self.ctx.cfg.adam.step(t, &mut p, &mut m, &mut v, &grad, scale);
            self.mem.write_f32(Buf::Master(g), 0, &p)?;
            self.mem.write_f32(Buf::ExpAvg(g), 0, &m)?;
            self.mem.write_f32(Buf::ExpAvgSq(g), 0, &v)?;
            p
        };
        // New bf16 weights: the whole buffer (stage 0), this rank's part of
        // the full buffer (stages 1–2, gathered next), or the shard (stage 3).
        let p_at = if matches!(plan.cfg.stage, 1 | 2) { at } else { 0 };
        self.mem.write_bf16(Buf::Param(g), p_at, &master)?;
        Ok(())
    }

    fn saved_bf16(&self, l: usize, a: Act, n: usize) -> Result<Vec<f32>, TrainError> {
        Ok(self.mem.read_bf16(Buf::Saved(l, a), 0, n)?)
    }

    fn save_bf16(&self, l: usize, a: Act, v: &mut [f32]) -> Result<(), TrainError> {
        round_bf16(v);
        Ok(self.mem.write_bf16(Buf::Saved(l, a), 0, v)?)
    }

    fn block_fwd(&mut self, l: usize) -> Result<(), TrainError> {
        let d = self.dims;
        let (t, h, i) = (d.tokens(), d.hidden, d.inter);
        let w = self.weights(l)?;
        let p = |k: GptBlock| self.tensor(&w, l, k.index());
        let x = self.mem.read_bf16(Buf::Hidden(l - 1), 0, t * h)?;
        let (mut ln1, m1, r1) = model::layernorm(&x, p(Ln1Weight), p(Ln1Bias), h);
        self.save_bf16(l, Act::Ln1, &mut ln1)?;
        self.mem.write_f32(Buf::Saved(l, Act::Ln1Mean), 0, &m1)?;
        self.mem.write_f32(Buf::Saved(l, Act::Ln1Rstd), 0, &r1)?;
        let mut qkv = model::linear(&ln1, p(QkvWeight), p(QkvBias), h, 3 * h);
        self.save_bf16(l, Act::Qkv, &mut qkv)?;
        let (mut att, lse) = model::attention(&qkv, &d);
        self.save_bf16(l, Act::Attn, &mut att)?;
        self.mem.write_f32(Buf::Saved(l, Act::Lse), 0, &lse)?;
        let proj = model::linear(&att, p(ProjWeight), p(ProjBias), h, h);
        let mut resid: Vec<f32> = x.iter().zip(&proj).map(|(a, b)| a + b).collect();
        self.save_bf16(l, Act::Resid, &mut resid)?;
        let (mut ln2, m2, r2) = model::layernorm(&resid, p(Ln2Weight), p(Ln2Bias), h);
        self.save_bf16(l, Act::Ln2, &mut ln2)?;
        self.mem.write_f32(Buf::Saved(l, Act::Ln2Mean), 0, &m2)?;
        self.mem.write_f32(Buf::Saved(l, Act::Ln2Rstd), 0, &r2)?;
        let mut fc = model::linear(&ln2, p(FcWeight), p(FcBias), h, i);
        self.save_bf16(l, Act::Fc, &mut fc)?;
        let mut ge = model::gelu(&fc);
        self.save_bf16(l, Act::Gelu, &mut ge)?;
        let mlp = model::linear(&ge, p(MlpWeight), p(MlpBias), i, h);
        let out: Vec<f32> = resid.iter().zip(&mlp).map(|(a, b)| a + b).collect();
        self.mem.write_bf16(Buf::Hidden(l), 0, &out)?;
        Ok(())
    }

    fn block_bwd(&mut self, l: usize) -> Result<(), TrainError> {
        let plan = self.ctx.plan;
        let d = self.dims;
        let (t, h, i) = (d.tokens(), d.hidden, d.inter);
        let w = self.weights(l)?;
        let p = |k: GptBlock| self.tensor(&w, l, k.index());
        let gr = &plan.groups[l];
        let mut grads = vec![0.0f32; gr.padded as usize];
        // One gradient slice per tensor, named by the block's layout.
        let mut parts: Vec<&mut [f32]> = Vec::with_capacity(GptBlock::ALL.len());
        let mut rest: &mut [f32] = &mut grads;
        for &n in &gr.tensors {
            let (a, b) = rest.split_at_mut(n as usize);
            parts.push(a);
            rest = b;
        }
        let [d_ln1_w, d_ln1_b, d_qkv_w, d_qkv_b, d_proj_w, d_proj_b, d_ln2_w, d_ln2_b, d_fc_w, d_fc_b, d_mlp_w, d_mlp_b]: [&mut [f32]; 12] =
            parts.try_into().expect("a GPT block has the 12 tensors of GptBlock::ALL");
        let dy = self.mem.read_f32(Buf::DHidden(l), 0, t * h)?;
        // MLP.
        let ge = self.saved_bf16(l, Act::Gelu, t * i)?;
        let fc = self.saved_bf16(l, Act::Fc, t * i)?;
        let ln2 = self.saved_bf16(l, Act::Ln2, t * h)?;
        let resid = self.saved_bf16(l, Act::Resid, t * h)?;
        let m2 = self.mem.read_f32(Buf::Saved(l, Act::Ln2Mean), 0, t)?;
        let r2 = self.mem.read_f32(Buf::Saved(l, Act::Ln2Rstd), 0, t)?;
        let dge = model::linear_bwd(&dy, &ge, p(MlpWeight), i, h, d_mlp_w, d_mlp_b);
        let dfc = model::gelu_bwd(&dge, &fc);
        let dln2 = model::linear_bwd(&dfc, &ln2, p(FcWeight), h, i, d_fc_w, d_fc_b);
        let dres_ln = model::layernorm_bwd(&dln2, &resid, &m2, &r2, p(Ln2Weight), d_ln2_w, d_ln2_b);
        let dresid: Vec<f32> = dy.iter().zip(&dres_ln).map(|(a, b)| a + b).collect();
        // Attention.
        let att = self.saved_bf16(l, Act::Attn, t * h)?;
        let datt = model::linear_bwd(&dresid, &att, p(ProjWeight), h, h, d_proj_w, d_proj_b);
        let qkv = self.saved_bf16(l, Act::Qkv, t * 3 * h)?;
        let lse = self.mem.read_f32(Buf::Saved(l, Act::Lse), 0, d.batch * d.heads * d.seq)?;
        let dqkv = model::attention_bwd(&datt, &qkv, &lse, &d);
        let ln1 = self.saved_bf16(l, Act::Ln1, t * h)?;
        let dln1 = model::linear_bwd(&dqkv, &ln1, p(QkvWeight), h, 3 * h, d_qkv_w, d_qkv_b);
        let x = self.mem.read_bf16(Buf::Hidden(l - 1), 0, t * h)?;
        let m1 = self.mem.read_f32(Buf::Saved(l, Act::Ln1Mean), 0, t)?;
        let r1 = self.mem.read_f32(Buf::Saved(l, Act::Ln1Rstd), 0, t)?;
        let dx_ln = model::layernorm_bwd(&dln1, &x, &m1, &r1, p(Ln1Weight), d_ln1_w, d_ln1_b);
        let dx: Vec<f32> = dresid.iter().zip(&dx_ln).map(|(a, b)| a + b).collect();
        self.mem.write_f32(Buf::DHidden(l - 1), 0, &dx)?;
        self.mem.write_bf16(plan.grad_full(l), 0, &grads)?;
        Ok(())
    }
}

/// Runs the plan's memory ops of `steps` steps on `alloc` without computing
/// (no contents are written): the figures a real run of this plan reaches,
/// e.g. a stage-0 reference for the same model and policy.
pub fn dry_run<D: Device>(plan: &Plan, steps: u64, alloc: SharedAllocator<D>) -> Result<RankStep, TrainError> {
    let mut mem = RankMemory::new(0, alloc, None);
    for op in plan.setup() {
        mem.apply(&op)?;
    }
    for s in 0..steps {
        for op in plan.step(s) {
            mem.apply(&op)?;
        }
    }
    let (peak, reserved) = mem.allocator().with(|a| (a.gauges().peak_reserved_bytes, a.gauges().reserved_bytes));
    Ok(RankStep {
        model_state_bytes: mem.state_live,
        layer_buffer_peak_bytes: mem.layer_peak,
        host_state_bytes: plan.state_bytes().host,
        peak_reserved_bytes: peak,
        reserved_bytes: reserved,
        comm_bytes: 0,
    })
}
