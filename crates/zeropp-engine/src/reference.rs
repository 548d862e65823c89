//! The sequential reference of a run: the same global batches, initialisation
//! and AdamW as the sharded engine, trained in one process with no
//! partitioning and no communication. ZeRO-3 with f32 communication must equal
//! it up to summation order; the equivalence tests of the engine and of
//! `zeropp-candle` compare against it, and so can a model of your own.
//!
//! ```
//! use zeropp_engine::config::{CommDtype, EngineConfig, ZeroConfig};
//! use zeropp_engine::reference::{Summation, train_sequential};
//! use zeropp_engine::data::{DataChoice, load_data};
//! use zeropp_engine::{Gpt, GptConfig, RunConfig, launch};
//! let (data, _) = load_data(&DataChoice::Markov { seed: 1, chars: 20_000 })?;
//! let model = Gpt::new(GptConfig::tiny().with_vocab(data.vocab_size()))?;
//! let zero = ZeroConfig { comm_dtype: CommDtype::F32, ..ZeroConfig::zero3() };
//! let run = RunConfig::tiny().with_zero(zero).with_steps(3);
//! let sharded = launch(&model, &data, &run)?;
//! let seq = train_sequential(&model, &data, &run.engine, 3, Summation::Batch)?;
//! for (s, want) in sharded.steps.iter().zip(&seq.losses) {
//!     assert!((s.loss - want).abs() < 1e-5 * want.abs());
//! }
//! # Ok::<(), zeropp_engine::EngineError>(())
//! ```

use crate::EngineError;
use crate::config::EngineConfig;
use crate::data::{TextDataset, shard};
use crate::model::{Model, full_forward_backward_at, init_params};
use crate::optim::{AdamW, clip_factor};

/// How a micro-batch's gradient is summed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Summation {
    /// One forward and backward over the whole micro-batch of the world.
    Batch,
    /// Per rank of `nodes × local` (each its shard of the micro-batch, as
    /// [`shard`] cuts it), summed over each node's ranks in order, then over
    /// the nodes in order, then divided by the world: the order of the
    /// engine's ordered reduction, so rounding does not blur a comparison.
    Ranks {
        /// Nodes.
        nodes: usize,
        /// Ranks per node.
        local: usize,
    },
}

/// What [`train_sequential`] returns.
#[derive(Debug, Clone, PartialEq)]
pub struct Reference {
    /// The mean loss of every step.
    pub losses: Vec<f32>,
    /// The final parameters, one flat vector per layer.
    pub params: Vec<Vec<f32>>,
}

/// Trains `model` on `data` for `steps` steps as `engine` says (seed, global
/// batch, gradient accumulation, clipping, AdamW), in this process alone.
pub fn train_sequential<M: Model>(
    model: &M,
    data: &TextDataset,
    engine: &EngineConfig,
    steps: usize,
    summation: Summation,
) -> Result<Reference, EngineError> {
    let e = engine;
    if e.grad_accum == 0 || !e.global_batch.is_multiple_of(e.grad_accum) {
        return Err(EngineError::InvalidConfig(format!(
            "global_batch {} is not a whole number of grad_accum {} micro-batches",
            e.global_batch, e.grad_accum
        )));
    }
    let mut params = init_params(model, e.seed)?;
    let mut opts: Vec<AdamW> = params.iter().map(|p| AdamW::new(e.optim, p.len())).collect();
    let micro = e.global_batch / e.grad_accum;
    let zeros =
        |params: &[Vec<f32>]| -> Vec<Vec<f32>> { params.iter().map(|p| vec![0.0; p.len()]).collect() };
    let add = |acc: &mut [Vec<f32>], g: &[Vec<f32>]| {
        for (a, g) in acc.iter_mut().zip(g) {
            a.iter_mut().zip(g).for_each(|(a, g)| *a += g);
        }
    };
    let mut losses = Vec::with_capacity(steps);
    for step in 0..steps {
        let mut acc = zeros(&params);
        let mut loss = 0.0;
        for m in 0..e.grad_accum {
            let b = data.global_batch(step as u64, m, micro, model.seq_len(), e.seed)?;
            match summation {
                Summation::Batch => {
                    let (l, g) = full_forward_backward_at(model, &params, &b, step as u64, m)?;
                    loss += l / e.grad_accum as f32;
                    add(&mut acc, &g);
                }
                Summation::Ranks { nodes, local } => {
                    let w = nodes * local;
                    let mut total = zeros(&params);
                    for node in 0..nodes {
                        let mut partial = zeros(&params);
                        for j in 0..local {
                            let (l, g) = full_forward_backward_at(
                                model,
                                &params,
                                &shard(&b, node * local + j, w)?,
                                step as u64,
                                m,
                            )?;
                            loss += l / (e.grad_accum * w) as f32;
                            add(&mut partial, &g);
                        }
                        add(&mut total, &partial);
                    }
                    total.iter_mut().flatten().for_each(|t| *t /= w as f32);
                    add(&mut acc, &total);
                }
            }
        }
        if e.grad_accum > 1 {
            acc.iter_mut().flatten().for_each(|a| *a /= e.grad_accum as f32);
        }
        let norm = acc.iter().flatten().map(|&g| f64::from(g) * f64::from(g)).sum::<f64>().sqrt() as f32;
        let f = clip_factor(norm, e.gradient_clipping);
        for ((p, g), o) in params.iter_mut().zip(&acc).zip(&mut opts) {
            o.step(p, g, f)?;
        }
        losses.push(loss);
    }
    Ok(Reference { losses, params })
}
