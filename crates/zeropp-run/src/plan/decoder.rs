//! [`Decoder`]: a Hugging Face Llama-family decoder (`LlamaForCausalLM` and
//! its kin) as FSDP2 shards it, by shape: from a `llama:` spec or a
//! model's `config.json`; its parameters in registration order and its FLOPs.

use serde_json::Value;

use super::compute::{Gemm, Work};
use crate::llama::LlamaShape;
use crate::{Result, RunError};

/// One parameter as FSDP2 sees it: its size along dim 0 (the dimension FSDP2
/// shards) and the product of the others.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Param {
    /// Rows: the size of dim 0.
    pub rows: usize,
    /// Elements per row (1 for a 1-D parameter).
    pub rest: usize,
    /// A 1-D parameter (a norm's gain, a bias): zeropp.torch sends it at its
    /// own precision.
    pub one_d: bool,
}

impl Param {
    fn matrix(rows: usize, cols: usize) -> Self {
        Self { rows, rest: cols, one_d: false }
    }

    fn vector(n: usize) -> Self {
        Self { rows: n, rest: 1, one_d: true }
    }

    /// Elements.
    pub fn numel(&self) -> usize {
        self.rows * self.rest
    }

    /// Elements of one rank's shard over `group` ranks, as FSDP2 pads it:
    /// dim 0 padded to a multiple of the group, then split.
    pub fn shard(&self, group: usize) -> usize {
        self.rows.div_ceil(group.max(1)) * self.rest
    }
}

/// A Llama-family decoder: RMSNorm, rotary attention with grouped key/value
/// heads, a SwiGLU MLP, and an untied (or tied) LM head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decoder {
    /// Vocabulary (`vocab_size`).
    pub vocab: usize,
    /// Width (`hidden_size`).
    pub hidden: usize,
    /// Decoder layers (`num_hidden_layers`).
    pub layers: usize,
    /// Attention heads (`num_attention_heads`).
    pub heads: usize,
    /// Key/value heads (`num_key_value_heads`).
    pub kv_heads: usize,
    /// Width per head (`head_dim`, else `hidden / heads`).
    pub head_dim: usize,
    /// SwiGLU width (`intermediate_size`).
    pub ff: usize,
    /// The LM head is the input embedding (`tie_word_embeddings`): one parameter.
    pub tied: bool,
    /// Biases on the query, key and value projections (Qwen2; Llama's `attention_bias`).
    pub qkv_bias: bool,
    /// A bias on the output projection (Llama's `attention_bias`).
    pub o_bias: bool,
    /// Biases on the MLP's projections (`mlp_bias`).
    pub mlp_bias: bool,
    /// Context: tokens per sequence.
    pub seq: usize,
}

impl Decoder {
    /// Llama 2's vocabulary, the default of a `llama:` spec.
    pub const DEFAULT_VOCAB: usize = 32000;

    /// The decoder of a `llama:` spec (the keys of `zeropp train --model
    /// llama:...`, plus `vocab=`), at context `seq`; `Ok(None)` when `spec`
    /// names no Llama. Key/value heads are the heads unless `kv_heads=` says
    /// otherwise, as in a Hugging Face config.
    ///
    /// ```
    /// use zeropp_run::plan::Decoder;
    /// let d = Decoder::from_spec("llama:d=768,layers=8,heads=12,kv_heads=4,ff=2048,vocab=32000", 128)?
    ///     .ok_or("a llama")?;
    /// assert_eq!(d.params(), 99_496_704); // the torch-scale bench's model
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn from_spec(spec: &str, seq: usize) -> Result<Option<Self>> {
        // `vocab=` is the planner's own key (training takes the data's vocabulary).
        let (name, keys) = spec.split_once(':').unwrap_or((spec, ""));
        let mut vocab = Self::DEFAULT_VOCAB;
        let mut rest = Vec::new();
        for kv in keys.split(',').map(str::trim).filter(|kv| !kv.is_empty()) {
            match kv.split_once('=') {
                Some((k, _)) if matches!(k.trim(), "seq" | "seq_len") => {
                    return Err(RunError::InvalidConfig(format!(
                        "model `{spec}`: a plan's context is --seq, not `{kv}`"
                    )));
                }
                Some((k, v)) if matches!(k.trim(), "vocab" | "vocab_size") => {
                    vocab = v.trim().parse::<usize>().ok().filter(|&x| x > 0).ok_or_else(|| {
                        RunError::InvalidConfig(format!("model `{spec}`: `{kv}` is not a positive integer"))
                    })?;
                }
                _ => rest.push(kv.to_string()),
            }
        }
        if !name.trim().eq_ignore_ascii_case("llama") {
            return Ok(None);
        }
        // A plan needs the shape: the training default's 64-wide toy is no job to plan.
        let value = |keys: &[&str]| -> Option<String> {
            rest.iter().find_map(|kv| {
                kv.split_once('=')
                    .filter(|(k, _)| keys.contains(&k.trim()))
                    .map(|(_, v)| v.trim().to_string())
            })
        };
        for (what, keys) in [
            ("d", &["d", "hidden_size"][..]),
            ("layers", &["layers", "num_hidden_layers"][..]),
            ("heads", &["heads", "num_attention_heads"][..]),
        ] {
            if value(keys).is_none() {
                return Err(RunError::InvalidConfig(format!(
                    "model `{spec}`: a plan's llama: spec needs d, layers and heads (`{what}=` is missing)"
                )));
            }
        }
        // As in a Hugging Face config, key/value heads default to the heads.
        let kv_given = value(&["kv_heads", "num_key_value_heads"]).is_some();
        if !kv_given && let Some(h) = value(&["heads", "num_attention_heads"]) {
            rest.push(format!("kv_heads={h}"));
        }
        let Some(shape) = LlamaShape::parse(&format!("{name}:{}", rest.join(",")))? else {
            return Ok(None);
        };
        let c = shape.config(vocab);
        let d = Self {
            vocab,
            hidden: c.d_model,
            layers: c.n_layer,
            heads: c.n_head,
            kv_heads: c.n_kv_head,
            head_dim: c.head_dim(),
            ff: c.d_ff,
            tied: c.tie_word_embeddings,
            qkv_bias: false,
            o_bias: false,
            mlp_bias: false,
            seq,
        };
        d.check()?;
        Ok(Some(d))
    }

    /// The decoder a Hugging Face `config.json` describes (`model_type`
    /// llama, mistral or qwen2), at context `seq`.
    ///
    /// ```
    /// use zeropp_run::plan::Decoder;
    /// let json = r#"{"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096,
    ///   "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32}"#;
    /// let d = Decoder::from_hf_config(json, 4096)?;
    /// assert_eq!(d.params(), 6_738_415_616); // Llama-2-7B
    /// # Ok::<(), zeropp_run::RunError>(())
    /// ```
    pub fn from_hf_config(json: &str, seq: usize) -> Result<Self> {
        let v: Value =
            serde_json::from_str(json).map_err(|source| RunError::Json { what: "--hf-config", source })?;
        let kind = v.get("model_type").and_then(Value::as_str).unwrap_or("");
        if !matches!(kind, "llama" | "mistral" | "qwen2") {
            return Err(RunError::InvalidConfig(format!(
                "--hf-config: model_type `{kind}`: the planner knows the Llama family's shapes \
                 (llama, mistral, qwen2); give the shape with --model llama:d=...,layers=...,heads=... instead"
            )));
        }
        let need = |k: &str| -> Result<usize> {
            v.get(k)
                .and_then(Value::as_u64)
                .and_then(|x| usize::try_from(x).ok())
                .filter(|&x| x > 0)
                .ok_or_else(|| {
                    RunError::InvalidConfig(format!(
                        "--hf-config: `{k}` is missing or not a positive integer"
                    ))
                })
        };
        let flag = |k: &str| v.get(k).and_then(Value::as_bool).unwrap_or(false);
        let (hidden, heads) = (need("hidden_size")?, need("num_attention_heads")?);
        let kv_heads = if v.get("num_key_value_heads").is_some_and(|x| !x.is_null()) {
            need("num_key_value_heads")?
        } else {
            heads
        };
        let head_dim = if v.get("head_dim").is_some_and(|x| !x.is_null()) {
            need("head_dim")?
        } else if hidden.is_multiple_of(heads) {
            hidden / heads
        } else {
            return Err(RunError::InvalidConfig(format!(
                "--hf-config: hidden_size {hidden} is not a multiple of num_attention_heads {heads}, and no head_dim"
            )));
        };
        let attention_bias = flag("attention_bias");
        let d = Self {
            vocab: need("vocab_size")?,
            hidden,
            layers: need("num_hidden_layers")?,
            heads,
            kv_heads,
            head_dim,
            ff: need("intermediate_size")?,
            tied: flag("tie_word_embeddings"),
            qkv_bias: attention_bias || kind == "qwen2",
            o_bias: attention_bias,
            mlp_bias: flag("mlp_bias"),
            seq,
        };
        d.check()?;
        Ok(d)
    }

    pub(crate) fn check(&self) -> Result<()> {
        let bad = |m: String| Err(RunError::InvalidConfig(format!("decoder shape: {m}")));
        if [self.vocab, self.hidden, self.layers, self.heads, self.kv_heads, self.head_dim, self.ff, self.seq]
            .contains(&0)
        {
            return bad(format!("{self:?}: every size must be positive"));
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return bad(format!(
                "{} heads are not a multiple of {} key/value heads",
                self.heads, self.kv_heads
            ));
        }
        // Every product the models form, in f64 first, so that none overflows usize.
        let f = |x: usize| x as f64;
        let (q, kv) = (f(self.heads) * f(self.head_dim), f(self.kv_heads) * f(self.head_dim));
        let (h, ff) = (f(self.hidden), f(self.ff));
        let layer = 2.0 * q * h + 2.0 * kv * h + 3.0 * h * ff + q + 2.0 * kv + 3.0 * ff + 4.0 * h;
        let total = f(self.layers) * layer + 2.0 * f(self.vocab) * h + h;
        if total > 1e15 || f(self.seq) * f(self.seq) * q > 1e18 {
            return bad(format!("{self:?} is beyond 1e15 parameters"));
        }
        Ok(())
    }

    /// One decoder layer's parameters, in `LlamaDecoderLayer`'s registration
    /// order: the attention's q, k, v, o (and biases), the MLP's gate, up,
    /// down (and biases), the two norms.
    pub fn layer_params(&self) -> Vec<Param> {
        let (d, q, kv, f) = (self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.ff);
        let mut p = Vec::new();
        for (rows, bias) in [(q, self.qkv_bias), (kv, self.qkv_bias), (kv, self.qkv_bias)] {
            p.push(Param::matrix(rows, d));
            if bias {
                p.push(Param::vector(rows));
            }
        }
        p.push(Param::matrix(d, q));
        if self.o_bias {
            p.push(Param::vector(d));
        }
        for (rows, cols) in [(f, d), (f, d), (d, f)] {
            p.push(Param::matrix(rows, cols));
            if self.mlp_bias {
                p.push(Param::vector(rows));
            }
        }
        p.extend([Param::vector(d), Param::vector(d)]);
        p
    }

    /// The root's own parameters (those outside the decoder layers): the
    /// embedding, the final norm and, untied, the LM head.
    pub fn root_params(&self) -> Vec<Param> {
        let mut p = vec![Param::matrix(self.vocab, self.hidden), Param::vector(self.hidden)];
        if !self.tied {
            p.push(Param::matrix(self.vocab, self.hidden));
        }
        p
    }

    /// Parameters.
    pub fn params(&self) -> usize {
        let sum = |ps: Vec<Param>| ps.iter().map(Param::numel).sum::<usize>();
        self.layers * sum(self.layer_params()) + sum(self.root_params())
    }

    /// FLOPs of one micro-batch of `batch` sequences, split (forward, the
    /// rest: backward twice the forward, and the layers' forward again under
    /// activation checkpointing). Forward: 2 per multiply-add of every
    /// projection and of the LM head, and `4·s·heads·head_dim` per token per
    /// layer for the attention's two products (the whole square, as
    /// Megatron-LM counts it).
    pub fn flops(&self, batch: usize, checkpointing: bool) -> (f64, f64) {
        let (b, s, l) = (batch as f64, self.seq as f64, self.layers as f64);
        let gemm: f64 = self.layer_params().iter().filter(|p| !p.one_d).map(|p| p.numel() as f64).sum();
        let attn = 4.0 * s * (self.heads * self.head_dim) as f64;
        let layers = b * s * l * (2.0 * gemm + attn);
        let head = 2.0 * b * s * (self.hidden * self.vocab) as f64;
        let forward = layers + head;
        (forward, 2.0 * forward + if checkpointing { layers } else { 0.0 })
    }

    /// Bytes a Hugging Face Llama decoder layer keeps per token for its backward
    /// (eager, SDPA attention without a mask, grouped key/value heads in SDPA),
    /// activations in `p`-byte elements, by the tensors of its graph: each
    /// RMSNorm its input upcast to fp32 and its output (`(4 + p)·h`); SDPA its
    /// rotated queries and keys, the values, its output and fp32 log-sum-exp
    /// (`p·(2·q + 2·kv) + 4·heads`, `q` and `kv` the projections' widths); the
    /// output projection its input, reshaped into a copy (`p·q`); the SwiGLU MLP
    /// the gate's output, its SiLU, the up projection's output and their product
    /// (`4·p·ff`).
    pub fn layer_activation_bytes(&self, p: f64) -> f64 {
        let (h, q, kv) =
            (self.hidden as f64, (self.heads * self.head_dim) as f64, (self.kv_heads * self.head_dim) as f64);
        2.0 * (4.0 + p) * h + p * (3.0 * q + 2.0 * kv) + 4.0 * self.heads as f64 + 4.0 * p * self.ff as f64
    }

    /// The GEMMs of one micro-batch of `batch` sequences (forward; their sum
    /// is [`Decoder::flops`]'s count): per layer the query, key, value and output
    /// projections, the SwiGLU's gate, up and down, attention's two products
    /// batched over sequences and heads; the LM head.
    ///
    /// ```
    /// use zeropp_run::plan::Decoder;
    /// let d = Decoder::from_spec("llama:d=512,layers=8,heads=8,kv_heads=4", 1024)?.ok_or("spec")?;
    /// assert_eq!(d.work(2).flops(false), d.flops(2, false));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn work(&self, batch: usize) -> Work {
        let (h, s, l, hd) = (self.hidden, self.seq, self.layers, self.head_dim);
        let (t, q, kv) = (batch * s, self.heads * hd, self.kv_heads * hd);
        Work {
            blocks: vec![
                Gemm::new(t, q, h, l),
                Gemm::new(t, kv, h, 2 * l),
                Gemm::new(t, h, q, l),
                Gemm::new(t, self.ff, h, 2 * l),
                Gemm::new(t, h, self.ff, l),
                Gemm::batched(s, s, hd, batch * self.heads, l),
                Gemm::batched(s, hd, s, batch * self.heads, l),
            ],
            head: vec![Gemm::new(t, self.vocab, h, 1)],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hf_configs_give_the_published_sizes() -> Result<()> {
        // Mistral-7B-v0.1 (GQA 32/8, untied): 7,241,732,096 parameters.
        let mistral = r#"{"model_type": "mistral", "vocab_size": 32000, "hidden_size": 4096,
            "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "tie_word_embeddings": false}"#;
        assert_eq!(Decoder::from_hf_config(mistral, 4096)?.params(), 7_241_732_096);
        // Qwen2-0.5B (q, k, v biases; tied): 494,032,768 parameters.
        let qwen = r#"{"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896,
            "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
            "num_key_value_heads": 2, "tie_word_embeddings": true}"#;
        assert_eq!(Decoder::from_hf_config(qwen, 4096)?.params(), 494_032_768);
        Ok(())
    }

    #[test]
    fn bad_configs_say_what_is_wrong() {
        for (json, says) in [
            (r#"{"model_type": "gpt2"}"#, "model_type `gpt2`"),
            (r#"{"model_type": "llama", "vocab_size": 10}"#, "`hidden_size` is missing"),
            (
                r#"{"model_type": "llama", "vocab_size": 10, "hidden_size": 64, "intermediate_size": 8,
                   "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 3}"#,
                "not a multiple",
            ),
            ("{", "--hf-config"),
        ] {
            let e = Decoder::from_hf_config(json, 64).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(e.contains(says), "{json}: {e}");
        }
        assert!(Decoder::from_spec("llama:vocab=0", 64).is_err());
        assert!(matches!(Decoder::from_spec("gpt", 64), Ok(None)));
        let mha = Decoder::from_spec("llama:d=128,layers=2,heads=8", 64)
            .ok()
            .flatten()
            .map(|d| (d.heads, d.kv_heads));
        assert_eq!(mha, Some((8, 8)));
        // Three heads pass (the training default's two key/value heads would refuse them).
        assert!(matches!(Decoder::from_spec("llama:d=96,layers=2,heads=3", 64), Ok(Some(_))));
        let e =
            Decoder::from_spec("llama:d=128,heads=8", 64).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("`layers=` is missing"), "{e}");
        let huge = r#"{"model_type": "llama", "vocab_size": 10, "hidden_size": 64, "intermediate_size": 8,
            "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 4611686018427387904}"#;
        assert!(Decoder::from_hf_config(huge, 64).is_err());
    }

    #[test]
    fn shards_pad_dim_zero_to_the_group() {
        let p = Param::matrix(10, 3);
        assert_eq!((p.shard(4), p.shard(5), p.shard(1)), (9, 6, 30));
        assert_eq!(Param::vector(3).shard(4), 1);
    }
}
