//! A next-token MLP over a fixed context window.
//!
//! Every position `t` of a sequence predicts its target from the window of
//! the `context` input tokens ending at `t` (inputs `t-context+1 ..= t` of
//! the same row), left-padded with token 0 where the window starts before
//! the row. The window's embeddings are concatenated, then go through
//! `layers` hidden `Linear + GELU` layers and a linear head to the
//! vocabulary, followed by the mean softmax cross-entropy.
//!
//! Layers (gather units): `embed` (`wte [vocab, hidden]`; the embedding
//! width equals `hidden`), `fc0..fc{layers-1}` (`weight [in, hidden]`,
//! `bias [hidden]`, with `in = context * hidden` for `fc0`), and `head`
//! (`weight [in, vocab]`, `bias [vocab]`, untied from the embedding).

use super::ops;
use super::stack::{
    Part, StackTape, TapeCore, backward_layer, check_sizes, forward_layer, init_parts, stack_model_items,
};
use super::{Batch, LayerSpec, Model, TensorSpec, fill_normal};
use crate::{EngineError, Result};

/// Shape of an [`Mlp`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MlpConfig {
    /// Vocabulary size.
    pub vocab: usize,
    /// Tokens in the context window of each prediction.
    pub context: usize,
    /// Embedding and hidden width.
    pub hidden: usize,
    /// Hidden `Linear + GELU` layers (0 means embeddings straight into the head).
    pub layers: usize,
    /// Maximum sequence length of a batch.
    pub seq_len: usize,
}

impl MlpConfig {
    /// A very small model for tests: vocab 11, context 3, hidden 8, 2 hidden layers, seq 6.
    pub fn tiny() -> Self {
        Self { vocab: 11, context: 3, hidden: 8, layers: 2, seq_len: 6 }
    }

    /// A small training model: vocab 64, context 8, hidden 64, 2 hidden layers, seq 64.
    pub fn default_small() -> Self {
        Self { vocab: 64, context: 8, hidden: 64, layers: 2, seq_len: 64 }
    }

    /// The same config with another vocabulary size.
    pub fn with_vocab(self, vocab: usize) -> Self {
        Self { vocab, ..self }
    }

    /// Checks that the sizes are positive.
    pub fn validate(&self) -> Result<(), EngineError> {
        let sizes = [("context", self.context), ("hidden", self.hidden), ("seq_len", self.seq_len)];
        check_sizes("mlp", self.vocab, &sizes)
    }
}

impl Default for MlpConfig {
    fn default() -> Self {
        Self::default_small()
    }
}

/// A context-window MLP language model (see the [module docs](self)).
#[derive(Debug, Clone)]
pub struct Mlp {
    cfg: MlpConfig,
    layers: Vec<LayerSpec>,
}

/// What the Mlp forward pass saves for backward, per micro-batch.
#[derive(Debug)]
pub struct MlpTape {
    /// The batch, the loss, the gradient of the loss w.r.t. the current
    /// backward layer's output, the call order.
    core: TapeCore,
    /// `xs[0]` = concatenated window embeddings; `xs[i + 1]` = output of hidden layer `i`.
    xs: Vec<Vec<f32>>,
    /// Pre-activations of the hidden layers.
    us: Vec<Vec<f32>>,
    probs: Vec<f32>,
}

impl StackTape for MlpTape {
    fn core(&mut self) -> &mut TapeCore {
        &mut self.core
    }
}

impl Mlp {
    /// An MLP of the given shape.
    pub fn new(cfg: MlpConfig) -> Result<Self, EngineError> {
        cfg.validate()?;
        let (v, h, c) = (cfg.vocab, cfg.hidden, cfg.context);
        let mut layers =
            vec![LayerSpec { name: "embed".into(), params: vec![TensorSpec::new("wte", vec![v, h])] }];
        for i in 0..cfg.layers {
            let din = if i == 0 { c * h } else { h };
            layers.push(LayerSpec {
                name: format!("fc{i}"),
                params: vec![TensorSpec::new("weight", vec![din, h]), TensorSpec::new("bias", vec![h])],
            });
        }
        let din = if cfg.layers == 0 { c * h } else { h };
        layers.push(LayerSpec {
            name: "head".into(),
            params: vec![TensorSpec::new("weight", vec![din, v]), TensorSpec::new("bias", vec![v])],
        });
        Ok(Self { cfg, layers })
    }

    /// The model's shape.
    pub fn config(&self) -> &MlpConfig {
        &self.cfg
    }

    /// Token at window slot `j` of row `r` (left-padded with 0).
    fn window_token(&self, tape: &MlpTape, r: usize, j: usize) -> usize {
        let (b, t) = (r / tape.core.seq, r % tape.core.seq);
        let c = self.cfg.context;
        // Window covers positions t + 1 - c ..= t; slot j is position t + 1 + j - c.
        match (t + 1 + j).checked_sub(c) {
            Some(pos) => tape.core.inputs[b * tape.core.seq + pos] as usize,
            None => 0,
        }
    }
}

impl Model for Mlp {
    type Tape = MlpTape;

    stack_model_items!("mlp");

    /// Embeddings `N(0, 1)`, weights `N(0, 1/fan_in)`, biases 0.
    fn init_layer(&self, layer: usize, seed: u64, out: &mut [f32]) -> Result<(), EngineError> {
        let (spec, parts) = init_parts(&self.layers, layer, out)?;
        for (i, (ps, buf)) in spec.params.iter().zip(parts).enumerate() {
            match ps.name.as_str() {
                "bias" => buf.fill(0.0),
                "wte" => fill_normal(buf, 1.0, seed, layer, i),
                _ => {
                    let fan_in = ps.shape.first().copied().unwrap_or(1).max(1);
                    fill_normal(buf, 1.0 / (fan_in as f64).sqrt(), seed, layer, i);
                }
            }
        }
        Ok(())
    }

    fn start(&self, batch: &Batch) -> Result<MlpTape, EngineError> {
        Ok(MlpTape {
            core: TapeCore::start(batch, self.cfg.vocab, self.cfg.seq_len, self.layers.len())?,
            xs: Vec::with_capacity(self.cfg.layers + 1),
            us: Vec::with_capacity(self.cfg.layers),
            probs: Vec::new(),
        })
    }

    fn forward(&self, layer: usize, params: &[f32], tape: &mut MlpTape) -> Result<()> {
        let (h, c, v) = (self.cfg.hidden, self.cfg.context, self.cfg.vocab);
        forward_layer(&self.layers, layer, params, tape, |part, spec, p, tape| {
            let n = tape.core.batch * tape.core.seq;
            match part {
                Part::Embed => {
                    let wte = p[0];
                    let mut x0 = vec![0.0; n * c * h];
                    for (r, row) in x0.chunks_exact_mut(c * h).enumerate() {
                        for (j, slot) in row.chunks_exact_mut(h).enumerate() {
                            let tok = self.window_token(tape, r, j);
                            slot.copy_from_slice(&wte[tok * h..(tok + 1) * h]);
                        }
                    }
                    tape.xs.push(x0);
                    Ok(())
                }
                Part::Head | Part::Hidden => {
                    let x = tape
                        .xs
                        .last()
                        .ok_or_else(|| EngineError::CallOrder("mlp forward without input".into()))?;
                    let din = spec.params[0].shape[0];
                    if part == Part::Head {
                        let mut logits = vec![0.0; n * v];
                        ops::linear_forward(x, p[0], p[1], n, din, v, &mut logits)?;
                        let loss = ops::softmax_xent_forward(&mut logits, &tape.core.targets, v)?;
                        tape.probs = logits;
                        tape.core.loss = loss as f32;
                    } else {
                        let mut u = vec![0.0; n * h];
                        ops::linear_forward(x, p[0], p[1], n, din, h, &mut u)?;
                        let mut a = vec![0.0; n * h];
                        ops::gelu_forward(&u, &mut a)?;
                        tape.us.push(u);
                        tape.xs.push(a);
                    }
                    Ok(())
                }
            }
        })
    }

    fn backward(&self, layer: usize, params: &[f32], tape: &mut MlpTape, grad: &mut [f32]) -> Result<()> {
        let (h, c, v) = (self.cfg.hidden, self.cfg.context, self.cfg.vocab);
        let missing = || EngineError::CallOrder("mlp backward without saved activations".into());
        backward_layer(&self.layers, layer, params, tape, grad, |part, spec, p, g, tape| {
            let n = tape.core.batch * tape.core.seq;
            match part {
                Part::Embed => {
                    let dwte = &mut g[0];
                    dwte.fill(0.0);
                    // Sequential scatter-add in row order: deterministic.
                    for r in 0..n {
                        for j in 0..c {
                            let tok = self.window_token(tape, r, j);
                            let src = &tape.core.dx[(r * c + j) * h..(r * c + j + 1) * h];
                            for (o, &d) in dwte[tok * h..(tok + 1) * h].iter_mut().zip(src) {
                                *o += d;
                            }
                        }
                    }
                    tape.xs.clear();
                    Ok(())
                }
                Part::Head | Part::Hidden => {
                    let din = spec.params[0].shape[0];
                    let [gw, gb] = g else {
                        return Err(EngineError::LengthMismatch {
                            what: "linear gradient tensors",
                            expected: 2,
                            got: g.len(),
                        });
                    };
                    let mut dx = vec![0.0; n * din];
                    if part == Part::Head {
                        let x = tape.xs.last().ok_or_else(missing)?;
                        let mut dlogits = std::mem::take(&mut tape.probs);
                        ops::softmax_xent_backward(&mut dlogits, &tape.core.targets, v)?;
                        ops::linear_backward(x, p[0], &dlogits, n, din, v, gw, gb, Some(&mut dx))?;
                    } else {
                        // This layer's output is no longer needed; its input is xs.last() after the pop.
                        tape.xs.pop().ok_or_else(missing)?;
                        let mut du = std::mem::take(&mut tape.core.dx);
                        let u = tape.us.pop().ok_or_else(missing)?;
                        ops::gelu_backward(&u, &mut du)?;
                        let x = tape.xs.last().ok_or_else(missing)?;
                        ops::linear_backward(x, p[0], &du, n, din, h, gw, gb, Some(&mut dx))?;
                    }
                    tape.core.dx = dx;
                    Ok(())
                }
            }
        })
    }
}
