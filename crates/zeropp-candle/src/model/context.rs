//! [`StageContext`]: what a stage knows about the run it is part of, training
//! or evaluation, and a seed that recompute replays.

use std::cell::Cell;

use candle_core::Tensor;
use zeropp_quant::rng::{splitmix64, stream_seed};

/// Handed to a stage written with
/// [`CandleModelBuilder::stage_with`](crate::CandleModelBuilder::stage_with):
/// the mode (training, or evaluation for `logits` and validation) and a seed
/// per stage and micro-batch.
///
/// Backward recomputes a stage from its input; it gets a context with the
/// same seed, and each call of [`StageContext::dropout`] (or
/// [`StageContext::next_seed`]) draws the same stream in the same order, so
/// the recompute drops exactly the forward's elements. The seed is derived
/// from the model's [`dropout_seed`](crate::CandleModelBuilder::dropout_seed),
/// the stage, the micro-batch's tokens and its step and micro-batch index
/// (the engine's, restored on resume): it changes from step to step (also
/// for a batch seen again, in a later epoch) and rank to rank, and is the
/// same on every run of the same job.
///
/// ```
/// use candle_nn::Module;
/// use zeropp_candle::CandleModel;
/// let (vocab, d) = (16, 8);
/// let model = CandleModel::builder("dropout", vocab, 4)
///     .stage("embed", move |vb, ids| candle_nn::embedding(vocab, d, vb)?.forward(ids))
///     .stage_with("head", move |vb, x, ctx| {
///         candle_nn::linear(d, vocab, vb)?.forward(&ctx.dropout(x, 0.1)?)
///     })
///     .build()?;
/// # Ok::<(), zeropp_candle::CandleError>(())
/// ```
#[derive(Debug)]
pub struct StageContext {
    train: bool,
    key: u64,
    calls: Cell<u64>,
    /// Whether the stage read the mode or a seed (the build's gradient check
    /// then checks it in training mode too).
    looked: Cell<bool>,
}

impl StageContext {
    pub(crate) fn new(train: bool, key: u64) -> Self {
        Self { train, key, calls: Cell::new(0), looked: Cell::new(false) }
    }

    /// Whether the stage has read the mode or a seed through this context.
    pub(crate) fn looked(&self) -> bool {
        self.looked.get()
    }

    /// Whether this is a training step (dropout on); false for evaluation.
    pub fn is_train(&self) -> bool {
        self.looked.set(true);
        self.train
    }

    /// This stage's seed for this micro-batch (the same in forward and recompute).
    pub fn seed(&self) -> u64 {
        self.looked.set(true);
        self.key
    }

    /// A fresh seed for one random draw of the stage: the `n`-th call gives
    /// the `n`-th seed of the stage's stream, in forward and recompute alike.
    pub fn next_seed(&self) -> u64 {
        self.looked.set(true);
        let n = self.calls.get();
        self.calls.set(n + 1);
        stream_seed(self.key, &[n])
    }

    /// Inverted dropout: in training, each element is zeroed with probability
    /// `p` and the rest are scaled by `1 / (1 - p)`; in evaluation, `x` as it
    /// is. The mask comes from [`StageContext::next_seed`], so a recompute
    /// replays it. Errors on `p` outside `[0, 1)`.
    pub fn dropout(&self, x: &Tensor, p: f32) -> candle_core::Result<Tensor> {
        if !(0.0..1.0).contains(&p) {
            candle_core::bail!("dropout probability {p} must be in [0, 1)")
        }
        let seed = self.next_seed();
        if !self.train || p == 0.0 {
            return Ok(x.clone());
        }
        let keep = 1.0 / (1.0 - p);
        let mask: Vec<f32> = (0..x.elem_count() as u64)
            .map(|i| {
                let u = (splitmix64(seed ^ splitmix64(i)) >> 40) as f32 / (1u32 << 24) as f32;
                if u < p { 0.0 } else { keep }
            })
            .collect();
        let mask = Tensor::from_vec(mask, x.shape(), x.device())?.to_dtype(x.dtype())?;
        x * mask
    }
}

/// The key of a micro-batch: `seed`, its shape, its tokens, and where it
/// runs (micro-batch `micro` of step `step`; `(0, 0)` outside training), so
/// a batch seen again in a later step draws new masks.
pub(crate) fn batch_key(seed: u64, inputs: &[u32], batch: usize, seq: usize, at: (u64, usize)) -> u64 {
    let tokens = inputs.iter().fold(splitmix64(inputs.len() as u64), |h, &t| splitmix64(h ^ u64::from(t)));
    stream_seed(seed, &[tokens, batch as u64, seq as u64, at.0, at.1 as u64])
}

/// The key of stage `layer` within a micro-batch of key `key`.
pub(crate) fn stage_key(key: u64, layer: usize) -> u64 {
    stream_seed(key, &[0xD50, layer as u64])
}
