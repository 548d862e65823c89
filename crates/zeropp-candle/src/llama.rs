//! A Llama-style decoder as a [`CandleModel`]: RMSNorm, rotary position
//! embeddings (the "rotate half" convention of Hugging Face and
//! candle-transformers), SwiGLU, grouped-query attention, untied `lm_head`.
//!
//! Everything is written with differentiable candle ops (no fused kernel
//! without a backward pass), and with Hugging Face's tensor names and
//! layouts: the gather units are `model.embed_tokens`, `model.layers.{i}`,
//! `model.norm` and `lm_head`, so an exported checkpoint
//! (`zeropp checkpoint export`) loads into
//! `candle_transformers::models::llama::Llama` as it is.

use candle_core::{D, DType, Device, Tensor};
use candle_nn::{Embedding, Init, Linear, Module, VarBuilder};

use crate::error::{CandleError, Result};
use crate::model::{CandleModel, CandleModelBuilder};

/// The shape of a Llama decoder.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LlamaConfig {
    /// Vocabulary size.
    pub vocab: usize,
    /// Hidden size (`hidden_size`).
    pub d_model: usize,
    /// Decoder layers (`num_hidden_layers`).
    pub n_layer: usize,
    /// Attention heads (`num_attention_heads`).
    pub n_head: usize,
    /// Key/value heads (`num_key_value_heads`; `n_head` for plain multi-head attention).
    pub n_kv_head: usize,
    /// SwiGLU width (`intermediate_size`).
    pub d_ff: usize,
    /// Longest sequence.
    pub seq_len: usize,
    /// RoPE base (`rope_theta`).
    pub rope_theta: f32,
    /// RMSNorm epsilon (`rms_norm_eps`).
    pub eps: f64,
    /// The LM head is the input embedding (`tie_word_embeddings`).
    pub tie_word_embeddings: bool,
    /// RMSNorm, RoPE and the attention softmax on candle-nn's fused kernels
    /// (through [`crate::ops`], the default), or written with composite
    /// tensor ops (slower; the reference they are checked against).
    pub fused_ops: bool,
}

impl LlamaConfig {
    /// A small decoder: `d` 64, 2 layers, 4 heads, 2 key/value heads, seq 64
    /// (about the native default GPT's size).
    pub fn small(vocab: usize) -> Self {
        Self::shape(vocab, 64, 2, 4, 2, 64)
    }

    /// A decoder of hidden size `d`, `layers` layers, `heads` heads (`kv_heads`
    /// of them for keys and values) and sequences of `seq` tokens; SwiGLU width
    /// `8d/3` rounded up to a multiple of 8, RoPE base 10000, eps 1e-5, an
    /// untied head, fused ops.
    pub fn shape(vocab: usize, d: usize, layers: usize, heads: usize, kv_heads: usize, seq: usize) -> Self {
        let d_ff = (8 * d).div_ceil(3).div_ceil(8) * 8;
        Self {
            vocab,
            d_model: d,
            n_layer: layers,
            n_head: heads,
            n_kv_head: kv_heads,
            d_ff,
            seq_len: seq,
            rope_theta: 10_000.0,
            eps: 1e-5,
            tie_word_embeddings: false,
            fused_ops: true,
        }
    }

    /// Head size `d_model / n_head`.
    pub fn head_dim(&self) -> usize {
        self.d_model / self.n_head.max(1)
    }

    /// Checks the sizes (positive; heads dividing the hidden size, key/value
    /// heads dividing the heads, an even head size for RoPE).
    pub fn validate(&self) -> Result<()> {
        let sizes = [
            ("vocab", self.vocab),
            ("d", self.d_model),
            ("layers", self.n_layer),
            ("heads", self.n_head),
            ("kv_heads", self.n_kv_head),
            ("d_ff", self.d_ff),
            ("seq", self.seq_len),
        ];
        if let Some((name, _)) = sizes.iter().find(|(_, v)| *v == 0) {
            return Err(CandleError::Config(format!("llama: {name} must be > 0")));
        }
        if !self.d_model.is_multiple_of(self.n_head) || !self.head_dim().is_multiple_of(2) {
            return Err(CandleError::Config(format!(
                "llama: d {} must be a multiple of heads {} with an even head size (RoPE rotates pairs)",
                self.d_model, self.n_head
            )));
        }
        if !self.n_head.is_multiple_of(self.n_kv_head) {
            return Err(CandleError::Config(format!(
                "llama: heads {} must be a multiple of kv_heads {}",
                self.n_head, self.n_kv_head
            )));
        }
        Ok(())
    }

    /// Parameters.
    pub fn num_params(&self) -> usize {
        let (d, hd) = (self.d_model, self.head_dim());
        let attn = d * self.n_head * hd * 2 + d * self.n_kv_head * hd * 2;
        let block = attn + 3 * d * self.d_ff + 2 * d;
        let embeddings = if self.tie_word_embeddings { 1 } else { 2 };
        embeddings * self.vocab * d + self.n_layer * block + d
    }

    /// Floats a decoder layer's recompute and backward keep alive per token, by
    /// the tensors of [`block`]'s graph (calibrated against a counting
    /// allocator, `tests/memory.rs`).
    fn block_floats_per_token(&self, seq: usize) -> usize {
        let (d, h, kv, hd, ff) = (self.d_model, self.n_head, self.n_kv_head, self.head_dim(), self.d_ff);
        // The fused attention keeps one [seq, seq] probability matrix per head
        // (P, for its backward); the composite form keeps scores, masked
        // scores and probabilities, and their gradients.
        let scores = if self.fused_ops { 2 } else { 6 };
        let attn = 3 * (h + 2 * kv) * hd + 4 * h * hd + scores * h * seq;
        let mlp = 5 * ff;
        2 * (12 * d + attn + mlp)
    }

    fn norm(&self, x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
        if self.fused_ops { rms_norm(x, w, self.eps) } else { rms_norm_composite(x, w, self.eps) }
    }

    /// The model: one stage per gather unit.
    pub fn build(&self) -> Result<CandleModel> {
        self.builder()?.build()
    }

    /// [`LlamaConfig::build`] before `build()`, to set options (keep the graph,
    /// matmul threads).
    pub fn builder(&self) -> Result<CandleModelBuilder> {
        self.validate()?;
        let c = *self;
        let mut b = CandleModel::builder("llama", c.vocab, c.seq_len)
            .stage("model.embed_tokens", move |vb, ids| embedding(c.vocab, c.d_model, vb)?.forward(ids));
        // The RoPE tables and the causal mask, once for the longest sequence
        // (each call narrows them to its length).
        let tables = std::sync::Arc::new(Tables::new(&c, c.seq_len, &Device::Cpu)?);
        for i in 0..c.n_layer {
            let tables = std::sync::Arc::clone(&tables);
            b = b.stage(format!("model.layers.{i}"), move |vb, x| block_with(&c, &tables, vb, x));
        }
        b = b
            .stage("model.norm", move |vb, x| c.norm(x, &norm_weight(c.d_model, vb)?))
            .stage("lm_head", move |vb, x| linear(c.d_model, c.vocab, vb)?.forward(x));
        if c.tie_word_embeddings {
            b = b.tie("model.embed_tokens.weight", "lm_head.weight");
        }
        let cfg = *self;
        Ok(b.activation_bytes(move |batch, seq, kept_stages| {
            let tokens = batch * seq;
            let kept = (cfg.n_layer + 2) * cfg.d_model + 3 * cfg.vocab;
            // Kept stages are the head, the final norm, then decoder layers from
            // the top. A layer's backward holds its graph and as much again in
            // gradients (`block_floats_per_token`, one layer at a time); each
            // other kept layer holds its graph, half of that, until its turn.
            let block = cfg.block_floats_per_token(seq);
            let kept_layers = kept_stages.saturating_sub(2).min(cfg.n_layer);
            let graphs = if kept_layers == 0 { block } else { (kept_layers + 1) * block / 2 };
            4 * tokens * (kept + graphs)
        }))
    }
}

/// The initialisation Hugging Face's Llama uses for every matrix: N(0, 0.02²).
const INIT: Init = Init::Randn { mean: 0.0, stdev: 0.02 };

fn embedding(vocab: usize, d: usize, vb: VarBuilder<'_>) -> candle_core::Result<Embedding> {
    Ok(Embedding::new(vb.get_with_hints((vocab, d), "weight", INIT)?, d))
}

fn linear(input: usize, output: usize, vb: VarBuilder<'_>) -> candle_core::Result<Linear> {
    Ok(Linear::new(vb.get_with_hints((output, input), "weight", INIT)?, None))
}

fn norm_weight(d: usize, vb: VarBuilder<'_>) -> candle_core::Result<Tensor> {
    vb.get_with_hints(d, "weight", Init::Const(1.0))
}

/// RMSNorm over the last dimension, `x / sqrt(mean(x²) + eps) * w`: candle-nn's
/// fused kernel with [`crate::ops::rms_norm`]'s backward pass.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    crate::ops::rms_norm(x, w, eps as f32)
}

/// [`rms_norm`] written with composite tensor ops (the reference the fused
/// form is checked against).
pub fn rms_norm_composite(x: &Tensor, w: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    let inv = (ms + eps)?.sqrt()?.recip()?;
    x.broadcast_mul(&inv)?.broadcast_mul(w)
}

/// The RoPE tables `(cos, sin)`, `[seq, head_dim / 2]`, computed as
/// candle-transformers' Llama computes them.
pub fn rope_tables(
    head_dim: usize,
    seq: usize,
    theta: f32,
    device: &Device,
) -> candle_core::Result<(Tensor, Tensor)> {
    let inv: Vec<f32> =
        (0..head_dim).step_by(2).map(|i| 1f32 / theta.powf(i as f32 / head_dim as f32)).collect();
    let inv = Tensor::from_vec(inv, (1, head_dim / 2), device)?;
    let pos = Tensor::arange(0, seq as u32, device)?.to_dtype(DType::F32)?.reshape((seq, 1))?;
    let angles = pos.matmul(&inv)?;
    Ok((angles.cos()?, angles.sin()?))
}

/// Rotary embedding of `x` (`[b, heads, seq, head_dim]`), "rotate half"
/// convention: the first and second halves of each head are the pairs;
/// candle-nn's fused kernel with [`crate::ops::rope`]'s backward pass.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> candle_core::Result<Tensor> {
    crate::ops::rope(x, cos, sin)
}

/// [`rope`] written with composite tensor ops (the reference).
pub fn rope_composite(x: &Tensor, cos: &Tensor, sin: &Tensor) -> candle_core::Result<Tensor> {
    let half = x.dim(D::Minus1)? / 2;
    let (x1, x2) = (x.narrow(D::Minus1, 0, half)?, x.narrow(D::Minus1, half, half)?);
    let (t, _) = cos.dims2()?;
    let cos = cos.reshape((1, 1, t, half))?;
    let sin = sin.reshape((1, 1, t, half))?;
    let a = (x1.broadcast_mul(&cos)? - x2.broadcast_mul(&sin)?)?;
    let b = (x2.broadcast_mul(&cos)? + x1.broadcast_mul(&sin)?)?;
    Tensor::cat(&[a, b], D::Minus1)
}

/// What every decoder layer uses and no weight holds: the RoPE tables and
/// the causal mask, for sequences up to some length.
#[derive(Debug, Clone)]
pub struct Tables {
    cos: Tensor,
    sin: Tensor,
    /// `[seq, seq]`: 0 on and below the diagonal, -inf above.
    mask: Tensor,
}

impl Tables {
    /// The tables of `c`'s heads for sequences of up to `seq` tokens.
    pub fn new(c: &LlamaConfig, seq: usize, device: &Device) -> candle_core::Result<Self> {
        let (cos, sin) = rope_tables(c.head_dim(), seq, c.rope_theta, device)?;
        let mask: Vec<f32> = (0..seq)
            .flat_map(|i| (0..seq).map(move |j| if j > i { f32::NEG_INFINITY } else { 0.0 }))
            .collect();
        Ok(Self { cos, sin, mask: Tensor::from_vec(mask, (seq, seq), device)? })
    }
}

/// One decoder layer (`model.layers.{i}`), pre-norm: attention then SwiGLU,
/// each added to the residual stream.
pub fn block(c: &LlamaConfig, vb: VarBuilder<'_>, x: &Tensor) -> candle_core::Result<Tensor> {
    block_with(c, &Tables::new(c, x.dim(1)?, x.device())?, vb, x)
}

/// [`block`] with tables made ahead (for sequences at least as long as `x`'s).
pub fn block_with(
    c: &LlamaConfig,
    tables: &Tables,
    vb: VarBuilder<'_>,
    x: &Tensor,
) -> candle_core::Result<Tensor> {
    let (b, t, d) = x.dims3()?;
    let (h, kv, hd) = (c.n_head, c.n_kv_head, c.head_dim());
    let attn_vb = vb.pp("self_attn");
    let xn = c.norm(x, &norm_weight(d, vb.pp("input_layernorm"))?)?;
    // In the activations' dtype (the tables are f32; the build's check runs f64).
    let (cos, sin) =
        (tables.cos.narrow(0, 0, t)?.to_dtype(x.dtype())?, tables.sin.narrow(0, 0, t)?.to_dtype(x.dtype())?);
    let project = |proj: &str, n: usize| -> candle_core::Result<Tensor> {
        linear(d, n * hd, attn_vb.pp(proj))?.forward(&xn)?.reshape((b, t, n, hd))
    };
    let (q, k, v) = (project("q_proj", h)?, project("k_proj", kv)?, project("v_proj", kv)?);
    let scale = 1.0 / (hd as f64).sqrt();
    let y = if c.fused_ops {
        // [b, t, heads, hd] throughout: RoPE and attention need no transpose.
        let (q, k) = (crate::ops::rope_thd(&q, &cos, &sin)?, crate::ops::rope_thd(&k, &cos, &sin)?);
        crate::ops::causal_attention(&q, &k, &v, scale)?
    } else {
        let heads = |x: Tensor| x.transpose(1, 2)?.contiguous();
        let (q, k, v) = (heads(q)?, heads(k)?, heads(v)?);
        let (q, k) = (rope_composite(&q, &cos, &sin)?, rope_composite(&k, &cos, &sin)?);
        // Grouped-query attention: each key/value head serves h / kv query heads.
        let repeat = |x: Tensor| -> candle_core::Result<Tensor> {
            if h == kv {
                return Ok(x);
            }
            x.unsqueeze(2)?.broadcast_as((b, kv, h / kv, t, hd))?.reshape((b, h, t, hd))
        };
        let (k, v) = (repeat(k)?, repeat(v)?);
        let mask = tables.mask.narrow(0, 0, t)?.narrow(1, 0, t)?.to_dtype(q.dtype())?;
        let scores = (q.matmul(&k.t()?)? * scale)?.broadcast_add(&mask)?;
        candle_nn::ops::softmax(&scores, D::Minus1)?.matmul(&v)?.transpose(1, 2)?
    };
    let y = y.reshape((b, t, h * hd))?;
    let x = (x + linear(h * hd, d, attn_vb.pp("o_proj"))?.forward(&y)?)?;
    let mlp_vb = vb.pp("mlp");
    let xn = c.norm(&x, &norm_weight(d, vb.pp("post_attention_layernorm"))?)?;
    let gate = linear(d, c.d_ff, mlp_vb.pp("gate_proj"))?.forward(&xn)?;
    let up = linear(d, c.d_ff, mlp_vb.pp("up_proj"))?.forward(&xn)?;
    let h = if c.fused_ops { crate::ops::silu_mul(&gate, &up)? } else { (gate.silu()? * up)? };
    x + linear(c.d_ff, d, mlp_vb.pp("down_proj"))?.forward(&h)?
}
