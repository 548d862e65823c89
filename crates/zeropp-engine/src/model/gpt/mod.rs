//! A character-level GPT with hand-written forward and backward passes.
//!
//! Layers (gather units):
//! - layer 0, `embed`: token embedding `wte [vocab, d]` and position embedding `wpe [seq_len, d]`;
//! - layers `1..=n_layer`, `block{i}`: one pre-LayerNorm transformer block,
//!   `x += proj(attn(ln1(x)))`, `x += fc_proj(gelu(fc(ln2(x))))`, with causal
//!   multi-head self-attention and the tanh-approximated GELU;
//! - layer `n_layer + 1`, `head`: final LayerNorm and an UNTIED LM head
//!   `lm_head.weight [vocab, d]` + bias, followed by the mean softmax
//!   cross-entropy. The head is untied so that every parameter belongs to
//!   exactly one gather unit. It is stored `[vocab, d]` (GPT-2's and
//!   PyTorch's layout) while the blocks' linears are `[in, out]`: a token's
//!   weights are contiguous, so a quantization group of qgZ and qwZ holds
//!   whole tokens' rows and never mixes a rare token's small gradient with a
//!   frequent token's large one on one scale. (Stored `[d, vocab]`, the
//!   head's AdamW update-direction error under qgZ grew with width, 0.09 to
//!   0.28 from 0.1M to 85M parameters; see PERFORMANCE.md.)
//!
//! ```
//! use zeropp_engine::model::{Gpt, GptConfig, Model};
//!
//! let model = Gpt::new(GptConfig::default_small().with_vocab(40))?;
//! assert_eq!(model.layers().len(), model.config().n_layer + 2);
//! assert_eq!(model.layers()[1].params[2].name, "attn.qkv.weight");
//! # Ok::<(), zeropp_engine::EngineError>(())
//! ```

use super::ops::{self, AttnShape};
use super::stack::{Part, StackTape, TapeCore, backward_layer, forward_layer, init_parts, stack_model_items};
use super::{Batch, LayerSpec, Model, TensorSpec, fill_normal};
use crate::{EngineError, Result};

mod config;

pub use config::GptConfig;

/// A character-level GPT (see the [module docs](self)).
#[derive(Debug, Clone)]
pub struct Gpt {
    cfg: GptConfig,
    layers: Vec<LayerSpec>,
}

/// What the Gpt forward pass saves for backward, per micro-batch.
#[derive(Debug)]
pub struct GptTape {
    /// The batch, the loss, the gradient of the loss w.r.t. the residual
    /// stream at the current backward position, the call order.
    core: TapeCore,
    /// Residual stream, `rows x d`.
    x: Vec<f32>,
    blocks: Vec<BlockActs>,
    head: Option<HeadActs>,
}

impl StackTape for GptTape {
    fn core(&mut self) -> &mut TapeCore {
        &mut self.core
    }
}

#[derive(Debug)]
struct BlockActs {
    xhat1: Vec<f32>,
    rstd1: Vec<f32>,
    h1: Vec<f32>,
    qkv: Vec<f32>,
    probs: Vec<f32>,
    att: Vec<f32>,
    xhat2: Vec<f32>,
    rstd2: Vec<f32>,
    h2: Vec<f32>,
    u: Vec<f32>,
    a: Vec<f32>,
}

#[derive(Debug)]
struct HeadActs {
    xhat: Vec<f32>,
    rstd: Vec<f32>,
    h: Vec<f32>,
    probs: Vec<f32>,
}

impl Gpt {
    /// A GPT of the given shape.
    pub fn new(cfg: GptConfig) -> Result<Self, EngineError> {
        cfg.validate()?;
        let (v, t, d) = (cfg.vocab, cfg.seq_len, cfg.d_model);
        let f = cfg.mlp_ratio * d;
        let mut layers = vec![LayerSpec {
            name: "embed".into(),
            params: vec![TensorSpec::new("wte", vec![v, d]), TensorSpec::new("wpe", vec![t, d])],
        }];
        for i in 0..cfg.n_layer {
            layers.push(LayerSpec {
                name: format!("block{i}"),
                params: vec![
                    TensorSpec::new("ln1.gamma", vec![d]),
                    TensorSpec::new("ln1.beta", vec![d]),
                    TensorSpec::new("attn.qkv.weight", vec![d, 3 * d]),
                    TensorSpec::new("attn.qkv.bias", vec![3 * d]),
                    TensorSpec::new("attn.proj.weight", vec![d, d]),
                    TensorSpec::new("attn.proj.bias", vec![d]),
                    TensorSpec::new("ln2.gamma", vec![d]),
                    TensorSpec::new("ln2.beta", vec![d]),
                    TensorSpec::new("mlp.fc.weight", vec![d, f]),
                    TensorSpec::new("mlp.fc.bias", vec![f]),
                    TensorSpec::new("mlp.proj.weight", vec![f, d]),
                    TensorSpec::new("mlp.proj.bias", vec![d]),
                ],
            });
        }
        layers.push(LayerSpec {
            name: "head".into(),
            params: vec![
                TensorSpec::new("ln_f.gamma", vec![d]),
                TensorSpec::new("ln_f.beta", vec![d]),
                TensorSpec::new("lm_head.weight", vec![v, d]),
                TensorSpec::new("lm_head.bias", vec![v]),
            ],
        });
        Ok(Self { cfg, layers })
    }

    /// The model's shape.
    pub fn config(&self) -> &GptConfig {
        &self.cfg
    }

    /// Total number of parameters.
    pub fn num_params(&self) -> usize {
        self.layers.iter().map(LayerSpec::numel).sum()
    }

    fn attn_shape(&self, tape: &GptTape) -> AttnShape {
        AttnShape {
            batch: tape.core.batch,
            seq: tape.core.seq,
            heads: self.cfg.n_head,
            head_dim: self.cfg.d_model / self.cfg.n_head,
        }
    }

    fn embed_forward(&self, p: &[&[f32]], tape: &mut GptTape) {
        let d = self.cfg.d_model;
        let (wte, wpe) = (p[0], p[1]);
        tape.x = vec![0.0; tape.core.inputs.len() * d];
        for (r, (row, &tok)) in tape.x.chunks_exact_mut(d).zip(&tape.core.inputs).enumerate() {
            let tok = tok as usize;
            let pos = r % tape.core.seq;
            let e = &wte[tok * d..(tok + 1) * d];
            let pe = &wpe[pos * d..(pos + 1) * d];
            for ((o, &a), &b) in row.iter_mut().zip(e).zip(pe) {
                *o = a + b;
            }
        }
    }

    fn embed_backward(&self, g: &mut [&mut [f32]], tape: &GptTape) {
        let d = self.cfg.d_model;
        for gi in g.iter_mut() {
            gi.fill(0.0);
        }
        // Sequential scatter-add in row order: deterministic.
        for (r, (drow, &tok)) in tape.core.dx.chunks_exact(d).zip(&tape.core.inputs).enumerate() {
            let tok = tok as usize;
            let pos = r % tape.core.seq;
            for (o, &v) in g[0][tok * d..(tok + 1) * d].iter_mut().zip(drow) {
                *o += v;
            }
            for (o, &v) in g[1][pos * d..(pos + 1) * d].iter_mut().zip(drow) {
                *o += v;
            }
        }
    }

    fn block_forward(&self, p: &[&[f32]], tape: &mut GptTape) -> Result<(), EngineError> {
        let d = self.cfg.d_model;
        let f = self.cfg.mlp_ratio * d;
        let n = tape.core.inputs.len();
        let s = self.attn_shape(tape);
        let mut a = BlockActs {
            xhat1: vec![0.0; n * d],
            rstd1: vec![0.0; n],
            h1: vec![0.0; n * d],
            qkv: vec![0.0; n * 3 * d],
            probs: vec![0.0; s.batch * s.heads * s.seq * s.seq],
            att: vec![0.0; n * d],
            xhat2: vec![0.0; n * d],
            rstd2: vec![0.0; n],
            h2: vec![0.0; n * d],
            u: vec![0.0; n * f],
            a: vec![0.0; n * f],
        };
        let mut tmp = vec![0.0; n * d];
        ops::layernorm_forward(&tape.x, p[0], p[1], n, d, &mut a.h1, &mut a.xhat1, &mut a.rstd1)?;
        ops::linear_forward(&a.h1, p[2], p[3], n, d, 3 * d, &mut a.qkv)?;
        ops::attention_forward(&a.qkv, s, &mut a.probs, &mut a.att)?;
        ops::linear_forward(&a.att, p[4], p[5], n, d, d, &mut tmp)?;
        add_into(&mut tape.x, &tmp);
        ops::layernorm_forward(&tape.x, p[6], p[7], n, d, &mut a.h2, &mut a.xhat2, &mut a.rstd2)?;
        ops::linear_forward(&a.h2, p[8], p[9], n, d, f, &mut a.u)?;
        ops::gelu_forward(&a.u, &mut a.a)?;
        ops::linear_forward(&a.a, p[10], p[11], n, f, d, &mut tmp)?;
        add_into(&mut tape.x, &tmp);
        tape.blocks.push(a);
        Ok(())
    }

    fn block_backward(
        &self,
        p: &[&[f32]],
        g: &mut [&mut [f32]],
        tape: &mut GptTape,
    ) -> Result<(), EngineError> {
        let d = self.cfg.d_model;
        let f = self.cfg.mlp_ratio * d;
        let n = tape.core.inputs.len();
        let s = self.attn_shape(tape);
        let a = tape
            .blocks
            .pop()
            .ok_or_else(|| EngineError::CallOrder("block backward without saved activations".into()))?;
        let mut dx = std::mem::take(&mut tape.core.dx);
        // MLP branch: x_out = x_mid + fc_proj(gelu(fc(ln2(x_mid)))).
        let mut da = vec![0.0; n * f];
        let [g0, g1, g2, g3, g4, g5, g6, g7, g8, g9, g10, g11] = g else {
            return Err(EngineError::LengthMismatch {
                what: "block gradient tensors",
                expected: 12,
                got: g.len(),
            });
        };
        ops::linear_backward(&a.a, p[10], &dx, n, f, d, g10, g11, Some(&mut da))?;
        ops::gelu_backward(&a.u, &mut da)?;
        let mut dh = vec![0.0; n * d];
        ops::linear_backward(&a.h2, p[8], &da, n, d, f, g8, g9, Some(&mut dh))?;
        ops::layernorm_backward(&dh, &a.xhat2, &a.rstd2, p[6], n, d, &mut dx, g6, g7)?;
        // Attention branch: x_mid = x_in + proj(attn(ln1(x_in))).
        let mut datt = vec![0.0; n * d];
        ops::linear_backward(&a.att, p[4], &dx, n, d, d, g4, g5, Some(&mut datt))?;
        let mut dqkv = vec![0.0; n * 3 * d];
        ops::attention_backward(&a.qkv, &a.probs, &datt, s, &mut dqkv)?;
        ops::linear_backward(&a.h1, p[2], &dqkv, n, d, 3 * d, g2, g3, Some(&mut dh))?;
        ops::layernorm_backward(&dh, &a.xhat1, &a.rstd1, p[0], n, d, &mut dx, g0, g1)?;
        tape.core.dx = dx;
        Ok(())
    }

    fn head_forward(&self, p: &[&[f32]], tape: &mut GptTape) -> Result<(), EngineError> {
        let (d, v) = (self.cfg.d_model, self.cfg.vocab);
        let n = tape.core.inputs.len();
        let mut h = HeadActs {
            xhat: vec![0.0; n * d],
            rstd: vec![0.0; n],
            h: vec![0.0; n * d],
            probs: vec![0.0; n * v],
        };
        ops::layernorm_forward(&tape.x, p[0], p[1], n, d, &mut h.h, &mut h.xhat, &mut h.rstd)?;
        ops::linear_with(ops::WeightLayout::OutIn, &h.h, p[2], p[3], [n, d, v], &mut h.probs)?;
        let loss = ops::softmax_xent_forward(&mut h.probs, &tape.core.targets, v)?;
        tape.core.loss = loss as f32;
        tape.head = Some(h);
        Ok(())
    }

    fn head_backward(
        &self,
        p: &[&[f32]],
        g: &mut [&mut [f32]],
        tape: &mut GptTape,
    ) -> Result<(), EngineError> {
        let (d, v) = (self.cfg.d_model, self.cfg.vocab);
        let n = tape.core.inputs.len();
        let mut h = tape
            .head
            .take()
            .ok_or_else(|| EngineError::CallOrder("head backward before head forward".into()))?;
        let [g0, g1, g2, g3] = g else {
            return Err(EngineError::LengthMismatch {
                what: "head gradient tensors",
                expected: 4,
                got: g.len(),
            });
        };
        ops::softmax_xent_backward(&mut h.probs, &tape.core.targets, v)?;
        let mut dh = vec![0.0; n * d];
        ops::linear_backward_with(
            ops::WeightLayout::OutIn,
            &h.h,
            p[2],
            &h.probs,
            [n, d, v],
            g2,
            g3,
            Some(&mut dh),
        )?;
        let mut dx = vec![0.0; n * d];
        ops::layernorm_backward(&dh, &h.xhat, &h.rstd, p[0], n, d, &mut dx, g0, g1)?;
        tape.core.dx = dx;
        Ok(())
    }
}

fn add_into(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

impl Model for Gpt {
    type Tape = GptTape;

    stack_model_items!("gpt");

    /// The tape: per block `8·n·d + 2·n·f + 2·n + b·h·T²` floats (normalized
    /// inputs, attention, MLP activations and probabilities), the residual
    /// stream `n·d`, the head's `2·n·d + n + n·v`; plus one block's backward
    /// temporaries, `6·n·d + n·f` (n = b·T rows, f the MLP width).
    fn activation_bytes(&self, batch: usize, seq: usize) -> usize {
        let (d, v, h) = (self.cfg.d_model, self.cfg.vocab, self.cfg.n_head);
        let f = self.cfg.mlp_ratio * d;
        let n = batch * seq;
        let block = 8 * n * d + 2 * n * f + 2 * n + batch * h * seq * seq;
        let floats = self.cfg.n_layer * block + n * d + 2 * n * d + n + n * v + 6 * n * d + n * f;
        4 * floats
    }

    /// GPT-2 style init: weights and embeddings `N(0, 0.02^2)`, residual
    /// projections (`attn.proj`, `mlp.proj`) scaled by `1/sqrt(2 n_layer)`,
    /// biases 0, LayerNorm gains 1.
    fn init_layer(&self, layer: usize, seed: u64, out: &mut [f32]) -> Result<(), EngineError> {
        let (spec, parts) = init_parts(&self.layers, layer, out)?;
        let resid_scale = 1.0 / ((2 * self.cfg.n_layer.max(1)) as f64).sqrt();
        for (i, (ps, buf)) in spec.params.iter().zip(parts).enumerate() {
            let name = ps.name.as_str();
            if name.ends_with("gamma") {
                buf.fill(1.0);
            } else if name.ends_with("beta") || name.ends_with("bias") {
                buf.fill(0.0);
            } else if name.ends_with("proj.weight") {
                fill_normal(buf, 0.02 * resid_scale, seed, layer, i);
            } else {
                fill_normal(buf, 0.02, seed, layer, i);
            }
        }
        Ok(())
    }

    fn start(&self, batch: &Batch) -> Result<GptTape, EngineError> {
        Ok(GptTape {
            core: TapeCore::start(batch, self.cfg.vocab, self.cfg.seq_len, self.layers.len())?,
            x: Vec::new(),
            blocks: Vec::with_capacity(self.cfg.n_layer),
            head: None,
        })
    }

    fn forward(&self, layer: usize, params: &[f32], tape: &mut GptTape) -> Result<()> {
        forward_layer(&self.layers, layer, params, tape, |part, _, p, tape| match part {
            Part::Embed => {
                self.embed_forward(p, tape);
                Ok(())
            }
            Part::Head => self.head_forward(p, tape),
            Part::Hidden => self.block_forward(p, tape),
        })
    }

    fn backward(&self, layer: usize, params: &[f32], tape: &mut GptTape, grad: &mut [f32]) -> Result<()> {
        backward_layer(&self.layers, layer, params, tape, grad, |part, _, p, g, tape| match part {
            Part::Embed => {
                self.embed_backward(g, tape);
                Ok(())
            }
            Part::Head => self.head_backward(p, g, tape),
            Part::Hidden => self.block_backward(p, g, tape),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn preset_parameter_counts_match_the_built_models() -> Result<(), EngineError> {
        for (name, g) in GptConfig::presets() {
            assert_eq!(g.num_params(), Gpt::new(g)?.num_params(), "{name}");
        }
        let sizes: Vec<usize> = GptConfig::presets().iter().map(|(_, g)| g.num_params()).collect();
        assert!(sizes.windows(2).all(|w| w[0] < w[1]), "presets are sorted by size: {sizes:?}");
        assert_eq!(GptConfig::preset("GPT2-Small").map(|g| g.d_model), Some(768));
        assert!(GptConfig::preset("gpt-7b").is_none());
        let too_long = GptConfig { seq_len: GptConfig::MAX_SEQ_LEN + 1, ..GptConfig::tiny() };
        assert!(too_long.validate().is_err());
        Ok(())
    }
}
