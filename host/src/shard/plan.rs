//! The ZeRO memory plan: which buffers a rank holds, of which kind and size,
//! and when each is allocated, used and freed — one schedule with two users.
//!
//! [`Plan::setup`] and [`Plan::step`] produce a list of [`Op`]s. The trainer
//! ([`crate::train`]) executes every op against its allocator and runs the
//! computation or collective named by each [`Exec`]; `wasmem synth --zero`
//! ([`Plan::events`]) only turns the memory ops into trace events. Both number
//! tensors in the order of their allocation, so a recorded training run and a
//! synthesized one are the same event stream by construction.
//!
//! Layer groups: group 0 holds the embeddings, groups `1..=L` the transformer
//! blocks, group `L+1` the final norm (and the head when it is not tied). Each
//! group's parameters live in one flat buffer padded to a multiple of the rank
//! count `N`, so every rank's shard has `padded / N` elements and the ranks'
//! plans are identical (they differ only in which part of the padding is
//! theirs).
//!
//! Per-rank model states (Ψ parameters, bf16 weights and gradients, fp32
//! master weights and Adam moments):
//!
//! | stage | weights | gradients | master + m + v | total |
//! |---|---|---|---|---|
//! | 0 | 2Ψ | 2Ψ | 12Ψ | 16Ψ |
//! | 1 | 2Ψ | 2Ψ | 12Ψ/N | 4Ψ + 12Ψ/N |
//! | 2 | 2Ψ | 2Ψ/N | 12Ψ/N | 2Ψ + 14Ψ/N |
//! | 3 | 2Ψ/N | 2Ψ/N | 12Ψ/N | 16Ψ/N |
//!
//! With offload the fp32 states are host memory (not in the device plan).
//! Layer buffers on top (the slack): stages 2 and 3 hold one full-size bf16
//! gradient buffer per group while its backward runs (two for a tied
//! embedding, which lives from the head's backward to the embedding's);
//! stage 3 holds the gathered bf16 weights of the running group and the
//! prefetched next one. A rank that runs more than one micro-batch per step
//! accumulates in an fp32 buffer of the group's full size (`Acc`, kind temp).

use crate::model::{Arch, ModelError, ModelSpec};
use crate::trace::Event;
use crate::types::{Phase, TensorKind};

/// ZeRO configuration of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ZeroConfig {
    /// ZeRO stage, 0 to 3.
    pub stage: u8,
    /// Data-parallel ranks.
    pub ranks: usize,
    /// fp32 master weights and Adam moments on the host, Adam on the CPU.
    pub offload: bool,
    /// Micro-batches per step over all ranks (a multiple of `ranks`).
    pub micro_batches: usize,
}

/// Why a ZeRO plan cannot be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// The model description is invalid.
    #[error("invalid model description: {0}")]
    Model(ModelError),
    /// A field of the ZeRO configuration is invalid.
    #[error("invalid ZeRO configuration: {field} {why}")]
    Config {
        /// The field.
        field: &'static str,
        /// What is wrong with it.
        why: String,
    },
    /// The plan trains in bf16 with fp32 master weights only.
    #[error("the ZeRO plan trains in bf16 with fp32 master weights: use dtype bf16")]
    NotMixedPrecision,
}

impl From<ModelError> for PlanError {
    fn from(e: ModelError) -> Self {
        PlanError::Model(e)
    }
}

impl ZeroConfig {
    /// Checks the configuration; names the bad field.
    pub fn validate(&self) -> Result<(), PlanError> {
        let bad = |field, why: String| Err(PlanError::Config { field, why });
        if self.stage > 3 {
            return bad("stage", format!("must be 0, 1, 2 or 3, not {}", self.stage));
        }
        if self.ranks == 0 || self.ranks > 1 << 20 {
            return bad("ranks", format!("must be between 1 and {}, not {}", 1 << 20, self.ranks));
        }
        if self.micro_batches == 0 || !self.micro_batches.is_multiple_of(self.ranks) {
            return bad(
                "micro-batches",
                format!("({}) must be a positive multiple of the ranks ({})", self.micro_batches, self.ranks),
            );
        }
        Ok(())
    }

    /// Micro-batches each rank runs per step.
    pub fn local_micro_batches(&self) -> usize {
        self.micro_batches / self.ranks
    }
}

/// One layer group: parameter tensors in one flat buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Group {
    /// Element count of each parameter tensor, in buffer order.
    pub tensors: Vec<u64>,
    /// Σ tensors.
    pub numel: u64,
    /// `numel` rounded up to a multiple of the rank count.
    pub padded: u64,
}

impl Group {
    /// Elements of one rank's shard.
    pub fn shard(&self, ranks: usize) -> u64 {
        self.padded / ranks as u64
    }

    /// Element offset of each tensor in the flat buffer.
    pub fn offsets(&self) -> Vec<u64> {
        self.tensors
            .iter()
            .scan(0u64, |o, &n| {
                let at = *o;
                *o += n;
                Some(at)
            })
            .collect()
    }
}

/// An activation a block saves for its backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Act {
    /// Output of the first LayerNorm.
    Ln1,
    /// Mean of the first LayerNorm (fp32, one per token).
    Ln1Mean,
    /// Reciprocal standard deviation of the first LayerNorm (fp32).
    Ln1Rstd,
    /// Fused query/key/value projection.
    Qkv,
    /// Log-sum-exp of every attention row (fp32), for the recomputation in backward.
    Lse,
    /// Attention output before its projection.
    Attn,
    /// Residual stream after attention.
    Resid,
    /// Output of the second LayerNorm.
    Ln2,
    /// Mean of the second LayerNorm (fp32).
    Ln2Mean,
    /// Reciprocal standard deviation of the second LayerNorm (fp32).
    Ln2Rstd,
    /// MLP up-projection before GELU.
    Fc,
    /// GELU output.
    Gelu,
    /// Another architecture's saved tensor (synthesis only), by index.
    Other(u16),
}

/// A buffer of the plan. A rank holds at most one buffer per key at a time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Buf {
    /// bf16 weights of a group: full (stages 0–2) or this rank's shard (stage 3).
    Param(usize),
    /// bf16 gradients of a group: full (stages 0–1) or this rank's shard (2–3).
    Grad(usize),
    /// fp32 master weights of a group (full at stage 0, else the shard).
    Master(usize),
    /// fp32 Adam first moment.
    ExpAvg(usize),
    /// fp32 Adam second moment.
    ExpAvgSq(usize),
    /// Stage 3: the all-gathered bf16 weights of a group.
    Gathered(usize),
    /// Stages 2–3: full bf16 gradients of a group while its backward runs.
    FullGrad(usize),
    /// fp32 gradient accumulation over a rank's micro-batches (full group).
    Acc(usize),
    /// Input tokens and targets (u32 each).
    Tokens,
    /// Input of block `l` (1-based); `Hidden(L)` is the last block's output.
    Hidden(usize),
    /// An activation saved by block `l`.
    Saved(usize, Act),
    /// Output of the final norm.
    Normed,
    /// Mean of the final norm (fp32).
    NormedMean,
    /// Reciprocal standard deviation of the final norm (fp32).
    NormedRstd,
    /// Logits, then (in place) their gradient (fp32).
    Logits,
    /// Gradient of the final norm's output (fp32).
    DNormed,
    /// Gradient of `Hidden(l)` (fp32).
    DHidden(usize),
}

/// A computation or collective the trainer runs at this point of the plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exec {
    /// Generate and write the tokens of local micro-batch `k`.
    LoadBatch(usize),
    /// Stage 3: all-gather a group's weight shards into `Gathered(g)`.
    Gather(usize),
    /// Token and position embeddings into `Hidden(0)`.
    EmbedFwd,
    /// Block `l` forward.
    BlockFwd(usize),
    /// Final norm forward.
    FinalFwd,
    /// Head, loss, and the logits' gradient.
    HeadLoss,
    /// Head backward.
    HeadBwd,
    /// Final norm backward.
    FinalBwd,
    /// Block `l` backward.
    BlockBwd(usize),
    /// Embedding backward.
    EmbedBwd,
    /// Add a group's micro-batch gradient to `Acc(g)` (`first`: overwrite).
    Accumulate {
        /// The group.
        group: usize,
        /// First micro-batch of the step.
        first: bool,
    },
    /// Reduce a group's gradient over ranks into `Grad(g)` (all-reduce at
    /// stages 0–1, reduce-scatter at 2–3), from `Acc(g)` when accumulating.
    Reduce(usize),
    /// AdamW on this rank's part of a group; writes the new bf16 weights.
    Adam(usize),
    /// Stages 1–2: all-gather the updated weight shards into `Param(g)`.
    GatherUpdated(usize),
}

/// One step of the plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// A training phase begins.
    Phase(Phase, u64),
    /// Allocate a buffer.
    Alloc {
        /// The buffer.
        buf: Buf,
        /// Bytes.
        bytes: u64,
        /// Kind.
        kind: TensorKind,
    },
    /// Free a buffer.
    Free(Buf),
    /// The next computation reads or writes this buffer.
    Use(Buf),
    /// A computation or collective (no memory effect of its own).
    Exec(Exec),
}

/// The plan of one rank (all ranks have the same plan).
#[derive(Debug, Clone)]
pub struct Plan {
    /// The model.
    pub spec: ModelSpec,
    /// The ZeRO configuration.
    pub cfg: ZeroConfig,
    /// Layer groups.
    pub groups: Vec<Group>,
}

/// Bytes of one bf16 element.
const BF16: u64 = 2;
/// Bytes of one fp32 element.
const F32: u64 = 4;

/// Per-rank model-state bytes of the plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct StateBytes {
    /// bf16 weights on the device (persistent).
    pub params: u64,
    /// bf16 gradients on the device (persistent).
    pub grads: u64,
    /// fp32 master weights and moments on the device.
    pub optim: u64,
    /// fp32 master weights and moments in host memory (offload).
    pub host: u64,
}

impl StateBytes {
    /// Device model-state bytes (params + grads + optim).
    pub fn device(&self) -> u64 {
        self.params + self.grads + self.optim
    }
}

impl Plan {
    /// The plan of `spec` under `cfg`.
    pub fn new(spec: &ModelSpec, cfg: ZeroConfig) -> Result<Self, PlanError> {
        spec.validate()?;
        cfg.validate()?;
        if spec.dtype_bytes != 2 || !spec.master_weights {
            return Err(PlanError::NotMixedPrecision);
        }
        let params = spec.parameters();
        let (prefix, per_layer) = spec.layout();
        let n = cfg.ranks as u64;
        let mk = |tensors: &[u64]| {
            let numel: u64 = tensors.iter().sum();
            Group { tensors: tensors.to_vec(), numel, padded: numel.div_ceil(n) * n }
        };
        let layers = spec.layers as usize;
        let mut groups = vec![mk(&params[..prefix])];
        for l in 0..layers {
            groups.push(mk(&params[prefix + l * per_layer..prefix + (l + 1) * per_layer]));
        }
        groups.push(mk(&params[prefix + layers * per_layer..]));
        Ok(Plan { spec: spec.clone(), cfg, groups })
    }

    /// Number of transformer blocks.
    pub fn layers(&self) -> usize {
        self.spec.layers as usize
    }

    /// The group of the output head.
    pub fn head_group(&self) -> usize {
        if self.spec.tied {
            0
        } else {
            self.layers() + 1
        }
    }

    /// Ψ: parameters of the model (without padding).
    pub fn parameters(&self) -> u64 {
        self.groups.iter().map(|g| g.numel).sum()
    }

    /// Where the weights of group `g` are read from during compute.
    pub fn weights(&self, g: usize) -> Buf {
        if self.cfg.stage == 3 {
            Buf::Gathered(g)
        } else {
            Buf::Param(g)
        }
    }

    /// Where a micro-batch's full gradient of group `g` is written.
    pub fn grad_full(&self, g: usize) -> Buf {
        if self.cfg.stage <= 1 {
            Buf::Grad(g)
        } else {
            Buf::FullGrad(g)
        }
    }

    /// Elements of `Param(g)`.
    pub fn param_elems(&self, g: usize) -> u64 {
        let gr = &self.groups[g];
        if self.cfg.stage == 3 {
            gr.shard(self.cfg.ranks)
        } else {
            gr.padded
        }
    }

    /// Elements of `Grad(g)`.
    pub fn grad_elems(&self, g: usize) -> u64 {
        let gr = &self.groups[g];
        if self.cfg.stage >= 2 {
            gr.shard(self.cfg.ranks)
        } else {
            gr.padded
        }
    }

    /// Elements of the optimizer's part of group `g` (master, m, v).
    pub fn optim_elems(&self, g: usize) -> u64 {
        let gr = &self.groups[g];
        if self.cfg.stage >= 1 {
            gr.shard(self.cfg.ranks)
        } else {
            gr.padded
        }
    }

    /// Persistent model-state bytes per rank, from the buffer sizes.
    pub fn state_bytes(&self) -> StateBytes {
        let mut s = StateBytes::default();
        for g in 0..self.groups.len() {
            s.params += self.param_elems(g) * BF16;
            s.grads += self.grad_elems(g) * BF16;
            let o = self.optim_elems(g) * 3 * F32;
            if self.cfg.offload {
                s.host += o;
            } else {
                s.optim += o;
            }
        }
        s
    }

    /// The ZeRO paper's per-rank model-state bytes for this stage (device
    /// part; with offload the fp32 states are excluded).
    pub fn formula_bytes(&self) -> f64 {
        let (p, n) = (self.parameters() as f64, self.cfg.ranks as f64);
        let optim = if self.cfg.offload { 0.0 } else { 12.0 };
        match self.cfg.stage {
            0 => 4.0 * p + optim * p,
            1 => 4.0 * p + optim * p / n,
            2 => 2.0 * p + 2.0 * p / n + optim * p / n,
            _ => 4.0 * p / n + optim * p / n,
        }
    }

    /// The most bytes of layer buffers (gathered weights, full gradients)
    /// the plan holds at once, as documented in the module header.
    pub fn slack_bytes(&self) -> u64 {
        let max = self.groups.iter().map(|g| g.padded).max().unwrap_or(0) * BF16;
        match self.cfg.stage {
            0 | 1 => 0,
            2 => 2 * max,
            _ => 4 * max,
        }
    }

    fn tokens(&self) -> u64 {
        self.spec.batch * self.spec.seq
    }

    /// Saved activations of one block: (name, bytes).
    pub fn saved(&self) -> Vec<(Act, u64)> {
        let s = &self.spec;
        let e = s.dtype_bytes;
        let t = self.tokens();
        let (bsh, bsi, stats) = (t * s.hidden * e, t * s.intermediate * e, t * F32);
        if s.arch == Arch::Gpt2 {
            vec![
                (Act::Ln1, bsh),
                (Act::Ln1Mean, stats),
                (Act::Ln1Rstd, stats),
                (Act::Qkv, 3 * bsh),
                (Act::Lse, s.batch * s.heads * s.seq * F32),
                (Act::Attn, bsh),
                (Act::Resid, bsh),
                (Act::Ln2, bsh),
                (Act::Ln2Mean, stats),
                (Act::Ln2Rstd, stats),
                (Act::Fc, bsi),
                (Act::Gelu, bsi),
            ]
        } else {
            // Other architectures: the synthesizer's recipe (not trainable here).
            crate::synth::layer_saved(s).into_iter().enumerate().map(|(i, b)| (Act::Other(i as u16), b)).collect()
        }
    }

    /// Allocations made once, before the first step: the persistent model states.
    pub fn setup(&self) -> Vec<Op> {
        let mut ops = Vec::new();
        for g in 0..self.groups.len() {
            ops.push(Op::Alloc { buf: Buf::Param(g), bytes: self.param_elems(g) * BF16, kind: TensorKind::Param });
            ops.push(Op::Alloc { buf: Buf::Grad(g), bytes: self.grad_elems(g) * BF16, kind: TensorKind::Grad });
            if !self.cfg.offload {
                let bytes = self.optim_elems(g) * F32;
                for buf in [Buf::Master(g), Buf::ExpAvg(g), Buf::ExpAvgSq(g)] {
                    ops.push(Op::Alloc { buf, bytes, kind: TensorKind::Optim });
                }
            }
        }
        ops
    }

    /// The ops of training step `step`.
    pub fn step(&self, step: u64) -> Vec<Op> {
        let mut b = Builder { plan: self, ops: Vec::new() };
        let a = self.cfg.local_micro_batches();
        for k in 0..a {
            b.micro_batch(step, k, a);
        }
        b.ops.push(Op::Phase(Phase::Optimizer, step));
        for g in 0..self.groups.len() {
            b.uses(&[Buf::Grad(g), Buf::Param(g)]);
            if !self.cfg.offload {
                b.uses(&[Buf::Master(g), Buf::ExpAvg(g), Buf::ExpAvgSq(g)]);
            }
            b.exec(Exec::Adam(g));
            if matches!(self.cfg.stage, 1 | 2) {
                b.exec(Exec::GatherUpdated(g));
            }
        }
        b.ops.push(Op::Phase(Phase::StepEnd, step));
        b.ops
    }

    /// The trace events of `steps` training steps (setup included), with
    /// tensor ids numbered from 1 in allocation order — what the trainer's
    /// event tap emits for the same plan.
    pub fn events(&self, steps: u64) -> Vec<Event> {
        let mut ev = EventNumbering::default();
        let mut out = Vec::new();
        for op in self.setup().iter().chain((0..steps).flat_map(|s| self.step(s)).collect::<Vec<_>>().iter()) {
            if let Some(e) = ev.event(op) {
                out.push(e);
            }
        }
        out
    }
}

/// Assigns trace ids to plan buffers in allocation order (ids start at 1 and
/// are never reused).
#[derive(Debug, Default)]
pub struct EventNumbering {
    next: u64,
    live: rustc_hash::FxHashMap<Buf, u64>,
}

impl EventNumbering {
    /// The trace event of a memory op (`None` for `Exec`). A free or use of a
    /// buffer that is not live yields `None` (the plan never does this).
    pub fn event(&mut self, op: &Op) -> Option<Event> {
        match *op {
            Op::Phase(phase, step) => Some(Event::Phase { phase, step }),
            Op::Alloc { buf, bytes, kind } => {
                self.next += 1;
                self.live.insert(buf, self.next);
                Some(Event::Alloc { id: self.next, bytes, kind, stream: 0, t_us: None })
            }
            Op::Free(buf) => self.live.remove(&buf).map(|id| Event::Free { id, t_us: None }),
            Op::Use(buf) => self.live.get(&buf).map(|&id| Event::Use { id, stream: None }),
            Op::Exec(_) => None,
        }
    }

    /// The trace id of a live buffer.
    pub fn id(&self, buf: Buf) -> Option<u64> {
        self.live.get(&buf).copied()
    }
}

struct Builder<'a> {
    plan: &'a Plan,
    ops: Vec<Op>,
}

impl Builder<'_> {
    fn alloc(&mut self, buf: Buf, bytes: u64, kind: TensorKind) {
        self.ops.push(Op::Alloc { buf, bytes, kind });
    }
    fn free(&mut self, buf: Buf) {
        self.ops.push(Op::Free(buf));
    }
    fn uses(&mut self, bufs: &[Buf]) {
        self.ops.extend(bufs.iter().map(|&b| Op::Use(b)));
    }
    fn exec(&mut self, e: Exec) {
        self.ops.push(Op::Exec(e));
    }
    fn stage3(&self) -> bool {
        self.plan.cfg.stage == 3
    }

    /// Stage 3: gathers group `g` into `Gathered(g)`.
    fn gather(&mut self, g: usize) {
        if self.stage3() {
            self.alloc(Buf::Gathered(g), self.plan.groups[g].padded * BF16, TensorKind::Param);
            self.uses(&[Buf::Param(g), Buf::Gathered(g)]);
            self.exec(Exec::Gather(g));
        }
    }

    fn release(&mut self, g: usize) {
        if self.stage3() {
            self.free(Buf::Gathered(g));
        }
    }

    /// Stages 2–3: the full gradient buffer of group `g` for this micro-batch.
    fn grad_buffer(&mut self, g: usize) {
        if self.plan.cfg.stage >= 2 {
            self.alloc(Buf::FullGrad(g), self.plan.groups[g].padded * BF16, TensorKind::Grad);
        }
    }

    /// The group's gradient of this micro-batch is complete: accumulate and,
    /// after the last micro-batch, reduce over ranks.
    fn finish_grad(&mut self, g: usize, k: usize, a: usize) {
        let full = self.plan.grad_full(g);
        if a > 1 {
            if k == 0 {
                self.alloc(Buf::Acc(g), self.plan.groups[g].padded * F32, TensorKind::Temp);
            }
            self.uses(&[full, Buf::Acc(g)]);
            self.exec(Exec::Accumulate { group: g, first: k == 0 });
        }
        if k + 1 == a {
            let src = if a > 1 { Buf::Acc(g) } else { full };
            self.uses(&[src, Buf::Grad(g)]);
            self.exec(Exec::Reduce(g));
            if a > 1 {
                self.free(Buf::Acc(g));
            }
        }
        if self.plan.cfg.stage >= 2 {
            self.free(Buf::FullGrad(g));
        }
    }

    fn micro_batch(&mut self, step: u64, k: usize, a: usize) {
        let p = self.plan;
        let s = &p.spec;
        let l_count = p.layers();
        let last = l_count + 1;
        let t = p.tokens();
        let e = s.dtype_bytes;
        let bsh = t * s.hidden * e;
        let dh = t * s.hidden * F32;
        let head = p.head_group();
        self.ops.push(Op::Phase(Phase::Forward, step));
        self.alloc(Buf::Tokens, t * 2 * 4, TensorKind::Other);
        self.exec(Exec::LoadBatch(k));
        // Forward.
        self.gather(0);
        self.alloc(Buf::Hidden(0), bsh, TensorKind::Activation);
        self.uses(&[Buf::Tokens, p.weights(0), Buf::Hidden(0)]);
        self.exec(Exec::EmbedFwd);
        self.release(0);
        self.gather(1.min(last));
        for l in 1..=l_count {
            // Prefetch the next group while this one computes.
            self.gather(l + 1);
            let saved = p.saved();
            for &(act, bytes) in &saved {
                self.alloc(Buf::Saved(l, act), bytes, TensorKind::Activation);
            }
            self.alloc(Buf::Hidden(l), bsh, TensorKind::Activation);
            self.uses(&[Buf::Hidden(l - 1), p.weights(l), Buf::Hidden(l)]);
            self.exec(Exec::BlockFwd(l));
            self.release(l);
        }
        self.alloc(Buf::Normed, bsh, TensorKind::Activation);
        self.alloc(Buf::NormedMean, t * F32, TensorKind::Activation);
        self.alloc(Buf::NormedRstd, t * F32, TensorKind::Activation);
        self.uses(&[Buf::Hidden(l_count), p.weights(last), Buf::Normed]);
        self.exec(Exec::FinalFwd);
        if head == 0 {
            self.gather(0);
        }
        self.alloc(Buf::Logits, t * s.vocab * F32, TensorKind::Temp);
        self.uses(&[Buf::Normed, p.weights(head), Buf::Logits, Buf::Tokens]);
        self.exec(Exec::HeadLoss);
        // Backward.
        self.ops.push(Op::Phase(Phase::Backward, step));
        self.grad_buffer(head);
        self.alloc(Buf::DNormed, dh, TensorKind::Temp);
        self.uses(&[Buf::Logits, Buf::Normed, p.weights(head), p.grad_full(head), Buf::DNormed]);
        self.exec(Exec::HeadBwd);
        self.free(Buf::Logits);
        if head == 0 {
            self.release(0);
            self.grad_buffer(last);
        }
        self.alloc(Buf::DHidden(l_count), dh, TensorKind::Temp);
        self.uses(&[Buf::DNormed, Buf::Hidden(l_count), p.weights(last), p.grad_full(last), Buf::DHidden(l_count)]);
        self.exec(Exec::FinalBwd);
        self.free(Buf::DNormed);
        self.free(Buf::Normed);
        self.free(Buf::NormedMean);
        self.free(Buf::NormedRstd);
        self.free(Buf::Hidden(l_count));
        self.release(last);
        self.finish_grad(last, k, a);
        for l in (1..=l_count).rev() {
            if l == l_count {
                self.gather(l);
            }
            if l > 1 {
                self.gather(l - 1);
            }
            self.grad_buffer(l);
            self.alloc(Buf::DHidden(l - 1), dh, TensorKind::Temp);
            self.uses(&[Buf::DHidden(l), Buf::Hidden(l - 1), p.weights(l), p.grad_full(l), Buf::DHidden(l - 1)]);
            self.exec(Exec::BlockBwd(l));
            self.free(Buf::DHidden(l));
            for (act, _) in p.saved() {
                self.free(Buf::Saved(l, act));
            }
            if l > 1 {
                self.free(Buf::Hidden(l - 1));
            }
            self.release(l);
            self.finish_grad(l, k, a);
        }
        if l_count > 0 {
            self.free(Buf::Hidden(0));
        }
        if head != 0 {
            self.grad_buffer(0);
        }
        self.uses(&[Buf::DHidden(0), Buf::Tokens, p.grad_full(0)]);
        self.exec(Exec::EmbedBwd);
        self.free(Buf::DHidden(0));
        self.free(Buf::Tokens);
        self.finish_grad(0, k, a);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny(stage: u8, ranks: usize, offload: bool) -> Plan {
        let spec = ModelSpec::preset("tiny").unwrap();
        Plan::new(&spec, ZeroConfig { stage, ranks, offload, micro_batches: ranks }).unwrap()
    }

    #[test]
    fn state_bytes_follow_the_formulas() {
        for stage in 0..=3 {
            for ranks in [1, 4, 8] {
                for offload in [false, true] {
                    let p = tiny(stage, ranks, offload);
                    let got = p.state_bytes().device() as f64;
                    let want = p.formula_bytes();
                    assert!((got - want).abs() / want < 0.01, "stage {stage} ranks {ranks}: {got} vs {want}");
                }
            }
        }
    }

    #[test]
    fn every_buffer_is_freed_once_and_only_states_stay() {
        for stage in 0..=3 {
            for (ranks, mb) in [(1, 1), (1, 3), (4, 4), (2, 4)] {
                let spec = ModelSpec { tied: stage % 2 == 0, ..ModelSpec::preset("tiny").unwrap() };
                let p = Plan::new(&spec, ZeroConfig { stage, ranks, offload: false, micro_batches: mb }).unwrap();
                let ev = p.events(2);
                let mut live = std::collections::HashSet::new();
                for e in &ev {
                    match e {
                        Event::Alloc { id, .. } => assert!(live.insert(*id)),
                        Event::Free { id, .. } => assert!(live.remove(id), "double free of {id}"),
                        Event::Use { id, .. } => assert!(live.contains(id), "use of dead {id}"),
                        Event::Phase { .. } => {}
                    }
                }
                // Every op on a buffer refers to a live one (no silent drops).
                let mut n = EventNumbering::default();
                let ops: Vec<Op> = p.setup().into_iter().chain(p.step(0)).collect();
                for op in &ops {
                    if !matches!(op, Op::Exec(_)) {
                        assert!(n.event(op).is_some(), "{op:?} refers to a buffer that is not live");
                    }
                }
                assert_eq!(live.len(), p.setup().len(), "stage {stage}: only the model states stay live");
            }
        }
    }

    #[test]
    fn llama_70b_on_1024_ranks_is_planned() {
        let spec = ModelSpec::preset("llama-70b").unwrap();
        let p = Plan::new(&spec, ZeroConfig { stage: 3, ranks: 1024, offload: false, micro_batches: 1024 }).unwrap();
        let s = p.state_bytes().device() as f64;
        assert!((s - 16.0 * p.parameters() as f64 / 1024.0).abs() / s < 0.01);
        assert!(!p.events(1).is_empty());
    }

    #[test]
    fn bad_configs_are_named() {
        let spec = ModelSpec::preset("tiny").unwrap();
        let e = Plan::new(&spec, ZeroConfig { stage: 4, ranks: 1, offload: false, micro_batches: 1 }).unwrap_err();
        assert!(matches!(e, PlanError::Config { field: "stage", .. }), "{e}");
        let e = Plan::new(&spec, ZeroConfig { stage: 1, ranks: 4, offload: false, micro_batches: 6 }).unwrap_err();
        assert!(e.to_string().contains("micro-batches"), "{e}");
        let fp32 = ModelSpec { dtype_bytes: 4, master_weights: false, ..spec };
        let e = Plan::new(&fp32, ZeroConfig { stage: 1, ranks: 1, offload: false, micro_batches: 1 }).unwrap_err();
        assert_eq!(e, PlanError::NotMixedPrecision);
    }
}
