//! The description of a transformer model and its training configuration,
//! shared by the trace synthesizer ([`crate::synth`]), the ZeRO memory plan
//! ([`crate::shard::plan`]) and the trainer ([`crate::train`]), with its
//! presets and the overrides a user applies to them ([`ModelOverrides`]).

use serde::Serialize;

/// A model description that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModelError {
    /// No preset has this name.
    #[error("unknown preset `{name}`: presets are {}", ModelSpec::PRESETS.join(", "))]
    UnknownPreset {
        /// The name asked for.
        name: String,
    },
    /// A field has a value the model cannot have.
    #[error("{field} {why}")]
    Field {
        /// The field.
        field: &'static str,
        /// What is wrong with it.
        why: String,
    },
}

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
    pub fn validate(&self) -> Result<(), ModelError> {
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
                return Err(ModelError::Field { field, why: "must be positive".into() });
            }
            if v > 1 << 24 {
                return Err(ModelError::Field { field, why: format!("= {v} is out of range") });
            }
        }
        if !self.hidden.is_multiple_of(self.heads) {
            let why = format!("({}) must be a multiple of heads ({})", self.hidden, self.heads);
            return Err(ModelError::Field { field: "hidden", why });
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            let why = format!("({}) must be a multiple of kv_heads ({})", self.heads, self.kv_heads);
            return Err(ModelError::Field { field: "heads", why });
        }
        if ![2, 4].contains(&self.dtype_bytes) {
            return Err(ModelError::Field {
                field: "dtype_bytes",
                why: format!("must be 2 or 4, not {}", self.dtype_bytes),
            });
        }
        let tokens = self.batch * self.seq;
        if tokens.checked_mul(self.vocab).and_then(|v| v.checked_mul(4)).is_none() {
            return Err(ModelError::Field { field: "vocab", why: "batch × seq × vocab overflows".into() });
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
                Arch::Gpt2 => p.extend(GptBlock::ALL.map(|t| t.numel(h, i))),
                Arch::Bert => p.extend([h * h, h, h * h, h, h * h, h, h * h, h, h, h, h * i, i, i * h, h, h, h]),
                Arch::Llama => p.extend([h, h * h, h * kv, h * kv, h * h, h, h * i, h * i, i * h]),
            }
        }
        match self.arch {
            Arch::Gpt2 => p.extend([h, h]), // GptFinal::NormWeight, NormBias
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
            Arch::Gpt2 => (2, GptBlock::ALL.len()),
            Arch::Bert => (5, 16),
            Arch::Llama => (1, 9),
        }
    }

    /// Number of parameters.
    pub fn parameter_count(&self) -> u64 {
        self.parameters().iter().sum()
    }
}

/// How a parameter tensor is initialized.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Init {
    /// All ones (norm weights).
    Ones,
    /// All zeros (biases).
    Zeros,
    /// Small random values.
    Normal,
    /// Small random values scaled down by the depth (projections into the residual stream).
    ResidualNormal,
}

/// The parameter tensors of a GPT-2 block, in buffer order: the order of
/// [`ModelSpec::parameters`] and of a layer group's flat buffer in the ZeRO
/// plan, which the trainer reads them by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GptBlock {
    /// First LayerNorm, weight.
    Ln1Weight,
    /// First LayerNorm, bias.
    Ln1Bias,
    /// Fused query/key/value projection, weight (hidden × 3·hidden).
    QkvWeight,
    /// Fused query/key/value projection, bias.
    QkvBias,
    /// Attention output projection, weight.
    ProjWeight,
    /// Attention output projection, bias.
    ProjBias,
    /// Second LayerNorm, weight.
    Ln2Weight,
    /// Second LayerNorm, bias.
    Ln2Bias,
    /// MLP up projection, weight (hidden × intermediate).
    FcWeight,
    /// MLP up projection, bias.
    FcBias,
    /// MLP down projection, weight (intermediate × hidden).
    MlpWeight,
    /// MLP down projection, bias.
    MlpBias,
}

impl GptBlock {
    /// Every tensor of a block, in buffer order.
    pub const ALL: [GptBlock; 12] = [
        GptBlock::Ln1Weight,
        GptBlock::Ln1Bias,
        GptBlock::QkvWeight,
        GptBlock::QkvBias,
        GptBlock::ProjWeight,
        GptBlock::ProjBias,
        GptBlock::Ln2Weight,
        GptBlock::Ln2Bias,
        GptBlock::FcWeight,
        GptBlock::FcBias,
        GptBlock::MlpWeight,
        GptBlock::MlpBias,
    ];

    /// Position in the block's buffer.
    pub const fn index(self) -> usize {
        self as usize
    }

    /// Elements, for hidden size `h` and MLP size `i`.
    pub const fn numel(self, h: u64, i: u64) -> u64 {
        match self {
            GptBlock::Ln1Weight | GptBlock::Ln1Bias | GptBlock::Ln2Weight | GptBlock::Ln2Bias => h,
            GptBlock::ProjBias | GptBlock::MlpBias => h,
            GptBlock::QkvWeight => h * 3 * h,
            GptBlock::QkvBias => 3 * h,
            GptBlock::ProjWeight => h * h,
            GptBlock::FcWeight => h * i,
            GptBlock::FcBias => i,
            GptBlock::MlpWeight => i * h,
        }
    }

    /// How the tensor is initialized.
    pub const fn init(self) -> Init {
        match self {
            GptBlock::Ln1Weight | GptBlock::Ln2Weight => Init::Ones,
            GptBlock::Ln1Bias | GptBlock::Ln2Bias => Init::Zeros,
            GptBlock::QkvBias | GptBlock::ProjBias | GptBlock::FcBias | GptBlock::MlpBias => Init::Zeros,
            GptBlock::ProjWeight | GptBlock::MlpWeight => Init::ResidualNormal,
            GptBlock::QkvWeight | GptBlock::FcWeight => Init::Normal,
        }
    }
}

/// The tensors of a GPT-2's first layer group (the embeddings), in buffer order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GptEmbed {
    /// Token embedding (vocab × hidden); also the output head when tied.
    Tokens,
    /// Learned position embedding (seq × hidden).
    Positions,
}

/// The tensors of a GPT-2's last layer group, in buffer order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GptFinal {
    /// Final LayerNorm, weight.
    NormWeight,
    /// Final LayerNorm, bias.
    NormBias,
    /// Output head (vocab × hidden), only when not tied to the token embedding.
    Head,
}

impl GptFinal {
    /// How the tensor is initialized.
    pub const fn init(self) -> Init {
        match self {
            GptFinal::NormWeight => Init::Ones,
            GptFinal::NormBias => Init::Zeros,
            GptFinal::Head => Init::Normal,
        }
    }
}

/// Changes to a preset, field by field (`None`: keep the preset's value),
/// as `wasmem synth` and `wasmem train` take them on the command line.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ModelOverrides {
    /// Transformer layers.
    pub layers: Option<u64>,
    /// Hidden size.
    pub hidden: Option<u64>,
    /// Attention heads (a multi-head preset stays multi-head: `kv_heads` follows).
    pub heads: Option<u64>,
    /// Key/value heads.
    pub kv_heads: Option<u64>,
    /// MLP intermediate size.
    pub intermediate: Option<u64>,
    /// Vocabulary size.
    pub vocab: Option<u64>,
    /// Sequence length.
    pub seq: Option<u64>,
    /// Micro-batch size.
    pub batch: Option<u64>,
    /// Element type: `fp32`, `bf16` or `fp16`.
    pub dtype: Option<String>,
    /// Optimizer: `adamw` (or `adam`) or `sgd`.
    pub optimizer: Option<String>,
    /// Activation checkpointing.
    pub checkpointing: Option<bool>,
    /// Training steps.
    pub steps: Option<u64>,
}

impl ModelOverrides {
    /// The preset `name` with these overrides applied, validated.
    pub fn apply(&self, name: &str) -> Result<ModelSpec, ModelError> {
        let mut s = ModelSpec::preset(name).ok_or_else(|| ModelError::UnknownPreset { name: name.to_string() })?;
        let set = |dst: &mut u64, v: Option<u64>| {
            if let Some(v) = v {
                *dst = v;
            }
        };
        set(&mut s.layers, self.layers);
        set(&mut s.hidden, self.hidden);
        // Multi-head presets stay multi-head when only `heads` changes.
        let mha = s.kv_heads == s.heads;
        set(&mut s.heads, self.heads);
        set(&mut s.kv_heads, self.kv_heads.or(self.heads.filter(|_| mha)));
        set(&mut s.intermediate, self.intermediate);
        set(&mut s.vocab, self.vocab);
        set(&mut s.seq, self.seq);
        set(&mut s.batch, self.batch);
        set(&mut s.steps, self.steps);
        if let Some(d) = &self.dtype {
            (s.dtype_bytes, s.master_weights) = match d.as_str() {
                "fp32" => (4, false),
                "bf16" | "fp16" => (2, true),
                other => {
                    let why = format!("`{other}` is not an element type (expected fp32, bf16 or fp16)");
                    return Err(ModelError::Field { field: "dtype", why });
                }
            };
        }
        if let Some(o) = &self.optimizer {
            s.optimizer = match o.as_str() {
                "adamw" | "adam" => Optimizer::Adamw,
                "sgd" => Optimizer::Sgd,
                other => {
                    let why = format!("`{other}` is not an optimizer (expected adamw or sgd)");
                    return Err(ModelError::Field { field: "optimizer", why });
                }
            };
        }
        if let Some(c) = self.checkpointing {
            s.checkpointing = c;
        }
        s.validate()?;
        Ok(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overrides_apply_and_name_bad_fields() {
        let s = ModelOverrides { heads: Some(8), layers: Some(2), ..Default::default() }.apply("gpt2-124m").unwrap();
        assert_eq!((s.heads, s.kv_heads, s.layers), (8, 8, 2));
        let e = ModelOverrides { dtype: Some("int4".into()), ..Default::default() }.apply("tiny").unwrap_err();
        assert!(e.to_string().contains("int4"), "{e}");
        let e = ModelOverrides { heads: Some(7), ..Default::default() }.apply("tiny").unwrap_err();
        assert!(e.to_string().contains("multiple of heads"), "{e}");
        assert!(matches!(ModelOverrides::default().apply("gpt5"), Err(ModelError::UnknownPreset { .. })));
    }
}
