//! # zeropp-engine
//!
//! The ZeRO-3 / ZeRO++ training engine of zeropp: models with hand-written
//! forward and backward passes, the training data, the optimizer, the stage
//! engine and the training loop.
//!
//! The model side is organised around the [`model::Model`] trait: a model is
//! an ordered list of gather units ([`model::LayerSpec`]); the engine gathers
//! the flat parameters of layer `i` before calling `forward(i)` /
//! `backward(i)`, so a model never owns its weights.
//!
//! - [`model`]: the `Model` contract and two models, [`model::Mlp`] and
//!   [`model::Gpt`], with GEMM through `matrixmultiply`.
//! - [`data`]: a seeded Markov text source with an exact entropy rate, a
//!   character-level text dataset and world-size-independent batch sampling.
//! - [`config`], [`deepspeed`]: the ZeRO-3 / ZeRO++ switches, batch arithmetic
//!   and a DeepSpeed JSON reader.
//! - [`optim`]: AdamW on f32 master shards.
//! - [`engine`]: the per-rank ZeRO-3 / ZeRO++ step (gathers, prefetch, hpZ,
//!   qgZ, clipping, skip on non-finite gradients) and the analytic byte model.
//! - [`metrics`], [`train`], [`compare`]: JSON Lines metrics, the training
//!   driver behind `zeropp train`, and the side-by-side runs of `zeropp compare`.

mod error;

pub mod data;
pub mod model;

// Training half: configuration, optimizer, ZeRO-3/ZeRO++ step, metrics, driver.
pub mod compare;
pub mod config;
pub mod deepspeed;
pub mod engine;
pub mod metrics;
pub mod optim;
pub mod train;
/// The MPI training driver behind `zeropp train --backend mpi` (feature `mpi`).
#[cfg(feature = "mpi")]
pub mod train_mpi;

pub use error::EngineError;
