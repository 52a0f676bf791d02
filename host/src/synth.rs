//! Synthesizes realistic allocation traces of transformer training from a
//! model description, with no input files.
//!
//! The model follows what eager PyTorch allocates for a decoder or encoder
//! stack trained with AdamW: parameters; per-layer activations saved for
//! backward with their true lifetimes (freed when the layer's backward has
//! run); forward and backward temporaries; gradients allocated in backward
//! and released by `zero_grad(set_to_none=True)`; optimizer states created
//! lazily at the first step; `foreach` optimizer temporaries spanning all
//! parameters; activation checkpointing (only layer inputs are kept, layers
//! are recomputed in backward).
//!
//! What it does not model: kernel workspaces (cuBLAS, flash-attention
//! scratch), autocast weight-cast caches, communication buffers, fragmentation
//! effects of view/resize operations, and data-loader pinned buffers.

use serde::Serialize;

use crate::trace::Event;
use crate::types::TensorKind;

/// Block architecture.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    /// GPT-2: pre-LayerNorm, biased projections, tanh-GELU composite, dropout, learned positions.
    Gpt2,
    /// BERT: post-LayerNorm encoder, erf-GELU, dropout, masked-LM head.
    Bert,
    /// Llama: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU, no biases, no dropout.
    Llama,
}

/// Optimizer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Optimizer {
    /// AdamW with two moment buffers per parameter (`foreach` implementation).
    Adamw,
    /// SGD without momentum (no state).
    Sgd,
}

/// A model and training configuration.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelSpec {
    /// Preset or user name.
    pub name: String,
    /// Block architecture.
    pub arch: Arch,
    /// Transformer layers.
    pub layers: u64,
    /// Hidden size.
    pub hidden: u64,
    /// Attention heads.
    pub heads: u64,
    /// Key/value heads (grouped-query attention when < heads).
    pub kv_heads: u64,
    /// MLP intermediate size.
    pub intermediate: u64,
    /// Vocabulary size.
    pub vocab: u64,
    /// Sequence length.
    pub seq: u64,
    /// Micro-batch size.
    pub batch: u64,
    /// Bytes per element of weights, gradients and activations (4: fp32, 2: bf16).
    pub dtype_bytes: u64,
    /// Mixed precision: fp32 master weights in the optimizer state.
    pub master_weights: bool,
    /// Optimizer.
    pub optimizer: Optimizer,
    /// Activation checkpointing per layer.
    pub checkpointing: bool,
    /// Tied input embedding and output head.
    pub tied: bool,
    /// Training steps.
    pub steps: u64,
}

impl ModelSpec {
    /// Built-in presets.
    pub const PRESETS: [&'static str; 6] = ["gpt2-124m", "bert-base", "llama-1b", "llama-7b", "llama-70b", "tiny"];

    /// A preset by name.
    pub fn preset(name: &str) -> Option<Self> {
        let base = ModelSpec {
            name: name.to_string(),
            arch: Arch::Gpt2,
            layers: 12,
            hidden: 768,
            heads: 12,
            kv_heads: 12,
            intermediate: 3072,
            vocab: 50257,
            seq: 1024,
            batch: 8,
            dtype_bytes: 4,
            master_weights: false,
            optimizer: Optimizer::Adamw,
            checkpointing: false,
            tied: true,
            steps: 3,
        };
        Some(match name {
            "gpt2-124m" => base,
            "bert-base" => ModelSpec { arch: Arch::Bert, vocab: 30522, seq: 512, batch: 32, tied: true, ..base },
            "llama-1b" => ModelSpec {
                arch: Arch::Llama,
                layers: 16,
                hidden: 2048,
                heads: 32,
                kv_heads: 8,
                intermediate: 8192,
                vocab: 128256,
                seq: 2048,
                batch: 4,
                dtype_bytes: 2,
                master_weights: true,
                tied: true,
                ..base
            },
            "llama-7b" => ModelSpec {
                arch: Arch::Llama,
                layers: 32,
                hidden: 4096,
                heads: 32,
                kv_heads: 32,
                intermediate: 11008,
                vocab: 32000,
                seq: 4096,
                batch: 1,
                dtype_bytes: 2,
                master_weights: true,
                checkpointing: true,
                tied: false,
                ..base
            },
            "llama-70b" => ModelSpec {
                arch: Arch::Llama,
                layers: 80,
                hidden: 8192,
                heads: 64,
                kv_heads: 8,
                intermediate: 28672,
                vocab: 128256,
                seq: 4096,
                batch: 1,
                dtype_bytes: 2,
                master_weights: true,
                checkpointing: true,
                tied: false,
                ..base
            },
            // The trainer's demo model (`wasmem train`): a small GPT trained
            // in bf16 with fp32 master weights.
            "tiny" => ModelSpec {
                layers: 4,
                hidden: 128,
                heads: 4,
                kv_heads: 4,
                intermediate: 512,
                vocab: 256,
                seq: 32,
                batch: 4,
                dtype_bytes: 2,
                master_weights: true,
                ..base
            },
            _ => return None,
        })
    }

    /// Checks the description; names the first bad field.
    pub fn validate(&self) -> Result<(), String> {
        for (field, v) in [
            ("layers", self.layers),
            ("hidden", self.hidden),
            ("heads", self.heads),
            ("kv_heads", self.kv_heads),
            ("intermediate", self.intermediate),
            ("vocab", self.vocab),
            ("seq", self.seq),
            ("batch", self.batch),
            ("steps", self.steps),
        ] {
            if v == 0 {
                return Err(format!("{field} must be positive"));
            }
            if v > 1 << 24 {
                return Err(format!("{field} = {v} is out of range"));
            }
        }
        if !self.hidden.is_multiple_of(self.heads) {
            return Err(format!("hidden ({}) must be a multiple of heads ({})", self.hidden, self.heads));
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return Err(format!("heads ({}) must be a multiple of kv_heads ({})", self.heads, self.kv_heads));
        }
        if ![2, 4].contains(&self.dtype_bytes) {
            return Err(format!("dtype_bytes must be 2 or 4, not {}", self.dtype_bytes));
        }
        let tokens = self.batch * self.seq;
        if tokens.checked_mul(self.vocab).and_then(|v| v.checked_mul(4)).is_none() {
            return Err("batch × seq × vocab overflows".into());
        }
        Ok(())
    }

    /// Parameter tensors (element counts), in registration order.
    pub fn parameters(&self) -> Vec<u64> {
        let (h, i, v) = (self.hidden, self.intermediate, self.vocab);
        let kv = self.kv_heads * (h / self.heads);
        let mut p = vec![v * h];
        if self.arch != Arch::Llama {
            p.push(self.seq * h); // learned positions (one per position of the sequence)
        }
        if self.arch == Arch::Bert {
            p.extend([2 * h, h, h]); // token types, embedding LayerNorm
        }
        for _ in 0..self.layers {
            match self.arch {
                Arch::Gpt2 => p.extend([h, h, h * 3 * h, 3 * h, h * h, h, h, h, h * i, i, i * h, h]),
                Arch::Bert => p.extend([h * h, h, h * h, h, h * h, h, h * h, h, h, h, h * i, i, i * h, h, h, h]),
                Arch::Llama => p.extend([h, h * h, h * kv, h * kv, h * h, h, h * i, h * i, i * h]),
            }
        }
        match self.arch {
            Arch::Gpt2 => p.extend([h, h]), // final LayerNorm weight and bias
            Arch::Llama => p.push(h),
            Arch::Bert => p.extend([h * h, h, h, h, v]),
        }
        if !self.tied {
            p.push(v * h);
        }
        p
    }

    /// (parameter tensors before the first layer, parameter tensors per layer).
    pub fn layout(&self) -> (usize, usize) {
        match self.arch {
            Arch::Gpt2 => (2, 12),
            Arch::Bert => (5, 16),
            Arch::Llama => (1, 9),
        }
    }

    /// Number of parameters.
    pub fn parameter_count(&self) -> u64 {
        self.parameters().iter().sum()
    }
}

/// Builds the event list.
struct Gen {
    events: Vec<Event>,
    next_id: u64,
}

impl Gen {
    fn alloc(&mut self, bytes: u64, kind: TensorKind) -> u64 {
        self.next_id += 1;
        let id = self.next_id;
        self.events.push(Event::Alloc { id, bytes, kind, stream: 0, t_us: None });
        self.events.push(Event::Use { id, stream: None });
        id
    }
    fn free(&mut self, id: u64) {
        self.events.push(Event::Free { id, t_us: None });
    }
    fn touch(&mut self, id: u64) {
        self.events.push(Event::Use { id, stream: None });
    }
    /// A temporary: allocated, used, freed.
    fn temp(&mut self, bytes: u64) {
        let t = self.alloc(bytes, TensorKind::Temp);
        self.free(t);
    }
}

/// Activations one layer saves for backward, as byte sizes.
pub(crate) fn layer_saved(s: &ModelSpec) -> Vec<u64> {
    let e = s.dtype_bytes;
    let tokens = s.batch * s.seq;
    let bsh = tokens * s.hidden * e;
    let bsi = tokens * s.intermediate * e;
    let kv = s.kv_heads * (s.hidden / s.heads);
    let stats = tokens * 4;
    let lse = s.batch * s.heads * s.seq * 4;
    match s.arch {
        // ln1 out + 2 stats, qkv, sdpa out + lse, c_proj out, dropout out, residual,
        // ln2 out + 2 stats, c_fc out + 4 tanh-GELU intermediates, mlp proj, dropout
        // (the residual sum is the layer output, counted by the caller).
        Arch::Gpt2 => {
            let mut v = vec![bsh, stats, stats, 3 * bsh, bsh, lse, bsh, bsh, bsh, bsh, stats, stats];
            v.extend([bsi; 5]);
            v.extend([bsh, bsh]);
            v
        }
        // q, k, v, sdpa out + lse, attn dense, dropout, residual, LN out + 2 stats,
        // intermediate + GELU out, output dense, dropout, residual, 2 LN stats (the LN
        // output is the layer output, counted by the caller).
        Arch::Bert => {
            let mut v = vec![bsh, bsh, bsh, bsh, lse, bsh, bsh, bsh, bsh, stats, stats];
            v.extend([bsi; 2]);
            v.extend([bsh, bsh, bsh, stats, stats]);
            v
        }
        // RMSNorm (fp32 input copy, rsqrt, normalized), q, k, v, rotated q and k,
        // sdpa out + lse, o_proj, residual, RMSNorm again, gate, up, silu(gate), product, down.
        Arch::Llama => {
            let f32h = tokens * s.hidden * 4;
            let kvb = tokens * kv * e;
            let mut v = vec![f32h, stats, bsh, bsh, kvb, kvb, bsh, kvb, bsh, lse, bsh, bsh, f32h, stats, bsh];
            v.extend([bsi; 4]);
            v.push(bsh);
            v
        }
    }
}

/// Synthesizes the events of `spec` (header excluded).
pub fn synth(spec: &ModelSpec) -> Result<Vec<Event>, String> {
    spec.validate()?;
    let e = spec.dtype_bytes;
    let tokens = spec.batch * spec.seq;
    let bsh = tokens * spec.hidden * e;
    let logits = tokens * spec.vocab * if spec.dtype_bytes == 2 { 2 } else { 4 };
    let logits_f32 = tokens * spec.vocab * 4;
    let params = spec.parameters();
    let mut g = Gen { events: Vec::new(), next_id: 0 };
    let param_ids: Vec<u64> = params.iter().map(|&n| g.alloc(n * e, TensorKind::Param)).collect();
    let mut optim_ids: Vec<u64> = Vec::new();
    let (prefix, per_layer) = spec.layout();
    let saved_recipe = layer_saved(spec);
    for step in 0..spec.steps {
        g.events.push(Event::Phase { phase: crate::types::Phase::Forward, step });
        let input = g.alloc(tokens * 8, TensorKind::Other);
        let mut hidden = g.alloc(bsh, TensorKind::Activation);
        g.temp(bsh);
        let mut layer_acts: Vec<Vec<u64>> = Vec::new();
        for layer in 0..spec.layers as usize {
            for &p in param_ids.iter().skip(prefix + layer * per_layer).take(per_layer) {
                g.touch(p);
            }
            let acts: Vec<u64> = if spec.checkpointing {
                // Only the layer input survives; the layer runs, its outputs die.
                let tmp: Vec<u64> = saved_recipe.iter().map(|&b| g.alloc(b, TensorKind::Temp)).collect();
                for t in tmp {
                    g.free(t);
                }
                vec![]
            } else {
                saved_recipe.iter().map(|&b| g.alloc(b, TensorKind::Activation)).collect()
            };
            let out = g.alloc(bsh, TensorKind::Activation);
            layer_acts.push(acts.into_iter().chain(std::iter::once(hidden)).collect());
            hidden = out;
        }
        let normed = g.alloc(bsh, TensorKind::Activation);
        // The logits are a model output the training loop drops; log-softmax
        // keeps its own output for backward.
        let logit = g.alloc(logits, TensorKind::Activation);
        let logsm = g.alloc(logits_f32, TensorKind::Activation);
        g.free(logit);
        let loss = g.alloc(4, TensorKind::Temp);
        g.events.push(Event::Phase { phase: crate::types::Phase::Backward, step });
        // Loss backward: gradient of log-softmax and of the logits.
        let g_logsm = g.alloc(logits_f32, TensorKind::Temp);
        let g_logit = g.alloc(logits, TensorKind::Temp);
        g.free(g_logsm);
        g.free(logsm);
        g.free(loss);
        let mut grads = vec![None; params.len()];
        let head = if spec.tied { 0 } else { params.len() - 1 };
        grads[head] = Some(g.alloc(params[head] * e, TensorKind::Grad));
        let mut g_hidden = g.alloc(bsh, TensorKind::Temp);
        g.free(g_logit);
        g.free(normed);
        g.free(hidden);
        for layer in (0..spec.layers as usize).rev() {
            let acts = layer_acts.pop().unwrap_or_default();
            let recomputed: Vec<u64> = if spec.checkpointing {
                saved_recipe.iter().map(|&b| g.alloc(b, TensorKind::Activation)).collect()
            } else {
                vec![]
            };
            // Gradients flowing through the MLP and attention.
            let g_mlp = g.alloc(tokens * spec.intermediate * e, TensorKind::Temp);
            g.temp(tokens * spec.intermediate * e);
            g.free(g_mlp);
            g.temp(bsh);
            g.temp(3 * bsh);
            for (k, slot) in grads.iter_mut().enumerate().skip(prefix + layer * per_layer).take(per_layer) {
                if slot.is_none() {
                    *slot = Some(g.alloc(params[k] * e, TensorKind::Grad));
                }
            }
            let next = g.alloc(bsh, TensorKind::Temp);
            g.free(g_hidden);
            g_hidden = next;
            for a in acts.into_iter().chain(recomputed) {
                g.free(a);
            }
        }
        for (k, slot) in grads.iter_mut().enumerate() {
            if slot.is_none() {
                *slot = Some(g.alloc(params[k] * e, TensorKind::Grad));
            }
        }
        g.free(g_hidden);
        g.free(input);
        g.events.push(Event::Phase { phase: crate::types::Phase::Optimizer, step });
        if spec.optimizer == Optimizer::Adamw {
            if optim_ids.is_empty() {
                let per_param = if spec.master_weights { 3 } else { 2 };
                for &n in &params {
                    for _ in 0..per_param {
                        optim_ids.push(g.alloc(n * 4, TensorKind::Optim));
                    }
                }
            }
            // foreach: each list op allocates one output per parameter.
            for _ in 0..2 {
                let list: Vec<u64> = params.iter().map(|&n| g.alloc(n * 4, TensorKind::Temp)).collect();
                for t in list {
                    g.free(t);
                }
            }
        }
        g.events.push(Event::Phase { phase: crate::types::Phase::StepEnd, step });
        // zero_grad(set_to_none=True)
        for id in grads.into_iter().flatten() {
            g.free(id);
        }
    }
    Ok(g.events)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_are_valid_and_sized() {
        for p in ModelSpec::PRESETS {
            let s = ModelSpec::preset(p).unwrap();
            s.validate().unwrap();
            let n = s.parameter_count();
            let expect = match p {
                "gpt2-124m" => 124_439_808.0,
                "bert-base" => 110_000_000.0,
                "llama-1b" => 1_240_000_000.0,
                "llama-70b" => 70_550_000_000.0,
                "tiny" => 830_000.0,
                _ => 6_740_000_000.0,
            };
            let rel = (n as f64 - expect).abs() / expect;
            assert!(rel < 0.05, "{p}: {n} parameters, expected about {expect}");
        }
    }

    #[test]
    fn events_balance() {
        let s = ModelSpec { steps: 2, ..ModelSpec::preset("gpt2-124m").unwrap() };
        let ev = synth(&s).unwrap();
        let allocs = ev.iter().filter(|e| matches!(e, Event::Alloc { .. })).count();
        let frees = ev.iter().filter(|e| matches!(e, Event::Free { .. })).count();
        // Parameters and optimizer states stay live.
        assert_eq!(allocs - frees, s.parameters().len() * 3);
    }

    #[test]
    fn bad_specs_name_the_field() {
        let s = ModelSpec { heads: 0, ..ModelSpec::preset("gpt2-124m").unwrap() };
        assert_eq!(s.validate().unwrap_err(), "heads must be positive");
        let s = ModelSpec { heads: 7, ..ModelSpec::preset("gpt2-124m").unwrap() };
        assert!(s.validate().unwrap_err().contains("multiple of heads"));
    }
}
