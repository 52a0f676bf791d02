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

use crate::model::{Arch, ModelError, ModelSpec, Optimizer};
use crate::trace::Event;
use crate::types::TensorKind;

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
pub fn synth(spec: &ModelSpec) -> Result<Vec<Event>, ModelError> {
    synth_with_seqs(spec, &[])
}

/// [`synth`] with the sequence length of step `s` taken from
/// `seqs[s % seqs.len()]` (batches of varying length; empty: `spec.seq`
/// every step). The model's parameters are those of `spec` (learned
/// positions for `spec.seq` positions: a step's length may not exceed it).
pub fn synth_with_seqs(spec: &ModelSpec, seqs: &[u64]) -> Result<Vec<Event>, ModelError> {
    spec.validate()?;
    let mut steps = Vec::with_capacity(seqs.len());
    for &q in seqs {
        if q == 0 || q > spec.seq {
            return Err(ModelError::Field {
                field: "seq-cycle",
                why: format!("has {q}: each length must be between 1 and the model's seq, {}", spec.seq),
            });
        }
        let st = ModelSpec { seq: q, ..spec.clone() };
        st.validate()?;
        steps.push(st);
    }
    let e = spec.dtype_bytes;
    let params = spec.parameters();
    let mut g = Gen { events: Vec::new(), next_id: 0 };
    let param_ids: Vec<u64> = params.iter().map(|&n| g.alloc(n * e, TensorKind::Param)).collect();
    let mut optim_ids: Vec<u64> = Vec::new();
    let (prefix, per_layer) = spec.layout();
    for step in 0..spec.steps {
        let st = if steps.is_empty() { spec } else { &steps[step as usize % steps.len()] };
        let tokens = st.batch * st.seq;
        let bsh = tokens * st.hidden * e;
        let logits = tokens * st.vocab * if st.dtype_bytes == 2 { 2 } else { 4 };
        let logits_f32 = tokens * st.vocab * 4;
        let saved_recipe = layer_saved(st);
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
    fn varying_lengths_change_activations_not_parameters() {
        let base = ModelSpec { steps: 3, ..ModelSpec::preset("tiny").unwrap() };
        let fixed = synth(&base).unwrap();
        let cycled = synth_with_seqs(&base, &[base.seq, base.seq / 2]).unwrap();
        let bytes = |ev: &[Event], kind: TensorKind| -> u64 {
            ev.iter()
                .map(|e| match e {
                    Event::Alloc { bytes, kind: k, .. } if *k == kind => *bytes,
                    _ => 0,
                })
                .sum()
        };
        assert_eq!(bytes(&fixed, TensorKind::Param), bytes(&cycled, TensorKind::Param));
        assert!(bytes(&cycled, TensorKind::Activation) < bytes(&fixed, TensorKind::Activation));
        let e = synth_with_seqs(&base, &[base.seq + 1]).unwrap_err().to_string();
        assert!(e.contains("seq-cycle") && e.contains(&(base.seq + 1).to_string()), "{e}");
        assert!(synth_with_seqs(&base, &[0]).is_err());
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
        assert_eq!(s.validate().unwrap_err().to_string(), "heads must be positive");
        let s = ModelSpec { heads: 7, ..ModelSpec::preset("gpt2-124m").unwrap() };
        assert!(s.validate().unwrap_err().to_string().contains("multiple of heads"));
    }
}
