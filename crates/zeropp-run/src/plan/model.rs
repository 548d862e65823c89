//! [`PlanModel`]: the GPT a plan is for, by shape or by parameter count, and
//! its FLOPs.

use zeropp_engine::model::GptConfig;

use super::compute::{Gemm, Work};
use crate::{Result, RunError};

/// The model the planner plans for: a GPT ([`GptConfig`]) of the shape given,
/// or derived from a parameter count ([`PlanModel::from_params`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanModel {
    /// The shape.
    pub gpt: GptConfig,
}

impl PlanModel {
    /// GPT-2's vocabulary, the default.
    pub const DEFAULT_VOCAB: usize = 50257;
    /// Width per attention head.
    pub const HEAD_DIM: usize = 128;

    /// The GPT of about `params` parameters with the default shape, GPT-3's
    /// aspect ratio of about 128 (13B is 40 × 5120, 175B 96 × 12288):
    /// `l = round((params / 196608)^(1/3))` blocks (`12·l·(128·l)² = params`),
    /// then the width, a multiple of 64, whose whole model (blocks, the
    /// untied embedding and head of `vocab` tokens, context `seq`) comes
    /// nearest to `params`; heads of 128 (of 64 where the width is not a
    /// multiple of 128), MLP ratio 4. An error when no such model comes
    /// within 10% of `params` (a vocabulary too large for so few parameters).
    ///
    /// ```
    /// use zeropp_run::plan::PlanModel;
    /// let m = PlanModel::from_params(18e9, PlanModel::DEFAULT_VOCAB, 2048)?;
    /// assert_eq!((m.gpt.n_layer, m.gpt.d_model), (45, 5696));
    /// assert!((m.params() as f64 / 18e9 - 1.0).abs() < 0.01);
    /// # Ok::<(), zeropp_run::RunError>(())
    /// ```
    pub fn from_params(params: f64, vocab: usize, seq: usize) -> Result<Self> {
        if !(params.is_finite() && (1e6..=1e14).contains(&params)) {
            return Err(RunError::InvalidConfig(format!("--params {params}: expected 1e6 to 1e14")));
        }
        let l = (params / 196_608.0).cbrt().round().max(1.0) as usize;
        let count = |h: usize| Self::shaped(l, h, vocab, seq).map(|m| m.params() as f64);
        // params grows with h: scan the multiples of 64 up to where it passes `params`.
        let mut best = (f64::INFINITY, 64);
        let mut h = 64;
        loop {
            let off = count(h)? - params;
            if off.abs() < best.0 {
                best = (off.abs(), h);
            }
            if off > 0.0 {
                break;
            }
            h += 64;
        }
        let m = Self::shaped(l, best.1, vocab, seq)?;
        if best.0 > 0.1 * params {
            return Err(RunError::InvalidConfig(format!(
                "--params {params:e}: the nearest GPT with a vocabulary of {vocab} has {} parameters",
                m.params()
            )));
        }
        Ok(m)
    }

    /// A GPT of `layers` blocks of width `hidden` (heads of 128, else of 64,
    /// else one head), vocabulary `vocab` and context `seq`.
    pub fn shaped(layers: usize, hidden: usize, vocab: usize, seq: usize) -> Result<Self> {
        check_shape(layers, hidden, vocab, seq)?;
        let n_head =
            [Self::HEAD_DIM, 64].into_iter().find(|d| hidden.is_multiple_of(*d)).map_or(1, |d| hidden / d);
        Ok(Self {
            gpt: GptConfig { vocab, seq_len: seq, d_model: hidden, n_head, n_layer: layers, mlp_ratio: 4 },
        })
    }

    /// This model with vocabulary `vocab` in place of its own (as training puts
    /// the data's vocabulary in place of a preset's); the rest of the shape,
    /// heads and MLP ratio included, is kept.
    ///
    /// ```
    /// use zeropp_engine::model::GptConfig;
    /// use zeropp_run::plan::PlanModel;
    /// let preset = PlanModel { gpt: GptConfig::preset("gpt-medium").ok_or("preset")? };
    /// assert_eq!(preset.with_vocab(32)?.gpt.vocab, 32);
    /// assert!(preset.with_vocab(usize::MAX).is_err());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn with_vocab(self, vocab: usize) -> Result<Self> {
        let g = self.gpt;
        check_shape(g.n_layer, g.d_model, vocab, g.seq_len)?;
        Ok(Self { gpt: g.with_vocab(vocab) })
    }

    /// Parameters.
    pub fn params(&self) -> usize {
        self.gpt.num_params()
    }

    /// FLOPs of one micro-batch of `batch` sequences (forward, backward, and
    /// the blocks' recomputation with checkpointing), split (forward, rest).
    pub fn flops(&self, batch: usize, checkpointing: bool) -> (f64, f64) {
        let g = &self.gpt;
        let (b, s, l, h, v, r) = (
            batch as f64,
            g.seq_len as f64,
            g.n_layer as f64,
            g.d_model as f64,
            g.vocab as f64,
            g.mlp_ratio as f64,
        );
        let blocks = (8.0 + 4.0 * r) * b * s * l * h * h + 4.0 * b * s * s * l * h;
        let head = 2.0 * b * s * h * v;
        let forward = blocks + head;
        let rest = 2.0 * forward + if checkpointing { blocks } else { 0.0 };
        (forward, rest)
    }
}

impl PlanModel {
    /// The GEMMs of one micro-batch of `batch` sequences (forward; their sum
    /// is [`PlanModel::flops`]'s count): per block the fused QKV, attention
    /// output and two MLP projections, and attention's two products batched
    /// over sequences and heads; the head.
    ///
    /// ```
    /// use zeropp_run::plan::PlanModel;
    /// let m = PlanModel::shaped(40, 6144, 50257, 512)?;
    /// let (f, rest) = m.work(2).flops(true);
    /// assert_eq!((f, rest), m.flops(2, true));
    /// # Ok::<(), zeropp_run::RunError>(())
    /// ```
    pub fn work(&self, batch: usize) -> Work {
        let g = &self.gpt;
        // (A GPT's width is its heads times their width: `shaped` and the presets keep it so.)
        let (h, s, l, a) = (g.d_model, g.seq_len, g.n_layer, g.n_head.max(1));
        let (t, r, d) = (batch * s, g.mlp_ratio * g.d_model, g.d_model / a);
        Work {
            blocks: vec![
                Gemm::new(t, 3 * h, h, l),
                Gemm::new(t, h, h, l),
                Gemm::new(t, r, h, l),
                Gemm::new(t, h, r, l),
                Gemm::batched(s, s, d, batch * a, l),
                Gemm::batched(s, d, s, batch * a, l),
            ],
            head: vec![Gemm::new(t, g.vocab, h, 1)],
        }
    }
}

/// A shape's sizes are positive and its parameter count and activations fit
/// in `usize` on the way (at most 1e15).
fn check_shape(layers: usize, hidden: usize, vocab: usize, seq: usize) -> Result<()> {
    if layers == 0 || hidden == 0 || vocab == 0 || seq == 0 {
        return Err(RunError::InvalidConfig(format!(
            "model shape: layers {layers}, hidden {hidden}, vocab {vocab}, seq {seq} must all be positive"
        )));
    }
    let (l, h, v, s) = (layers as f64, hidden as f64, vocab as f64, seq as f64);
    if 12.0 * l * h * h + 2.0 * v * h + s * h > 1e15 || s * s * h > 1e15 {
        return Err(RunError::InvalidConfig(format!(
            "model shape: layers {layers}, hidden {hidden}, vocab {vocab}, seq {seq} is beyond 1e15 parameters"
        )));
    }
    Ok(())
}
