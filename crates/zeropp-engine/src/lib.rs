//! # zeropp-engine
//!
//! The ZeRO-3 / ZeRO++ training engine of zeropp: models with hand-written
//! forward and backward passes, the training data, the optimizer, the stage
//! engine and the training loop.
//!
//! The door is [`launch()`]: it runs any [`Model`] on any
//! [`data::TextDataset`] as a [`RunConfig`] says (cluster, [`EngineConfig`]
//! with its [`ZeroConfig`] switches, schedule, checkpoints, metrics), on
//! threads or under an MPI launcher ([`Backend`]), and returns a
//! [`TrainReport`]. [`Launch`] is the same call with options (progress,
//! start-up callback). The crate's root names that door, its configuration,
//! the [`Model`] contract with the built-in models, and the error type; the
//! rest is in the modules (docs/ARCHITECTURE.md, "API boundaries", says which
//! are internal: [`engine`]'s per-rank step). The run layer behind the CLI
//! (the built-in models by name, `zeropp compare`, the DeepSpeed reader) is
//! the `zeropp-run` crate, above this one and zeropp-candle.
//!
//! ```
//! use zeropp_engine::data::TextDataset;
//! use zeropp_engine::{Gpt, GptConfig, RunConfig, ZeroConfig, launch};
//! let data = TextDataset::from_text(&"to be, or not to be: that is the question. ".repeat(200))?;
//! let model = Gpt::new(GptConfig::tiny().with_vocab(data.vocab_size()))?;
//! let run = RunConfig::tiny().with_steps(2).with_zero(ZeroConfig::zeropp(2));
//! let report = launch(&model, &data, &run)?;
//! assert_eq!(report.summary.mode, "zeropp");
//! assert_eq!(report.steps.len(), 2);
//! # Ok::<(), zeropp_engine::EngineError>(())
//! ```
//!
//! The model side is organised around the [`Model`] trait: a model is an
//! ordered list of gather units ([`model::LayerSpec`]); the engine gathers the
//! flat parameters of layer `i` before calling `forward(i)` / `backward(i)`, so
//! a model never owns its weights.
//!
//! - [`model`]: the `Model` contract and two models, [`Mlp`] and [`Gpt`], with
//!   GEMM through `matrixmultiply`.
//! - [`data`]: a seeded Markov text source with an exact entropy rate, a
//!   character-level text dataset, world-size-independent batch sampling, and
//!   [`data::DataChoice`], where a run's text comes from.
//! - [`config`]: the ZeRO-3 / ZeRO++ switches and batch arithmetic.
//! - [`optim`]: AdamW on f32 master shards; [`reference`](mod@reference): the sequential
//!   reference a sharded run must equal.
//! - [`engine`]: the per-rank ZeRO-3 / ZeRO++ step (gathers, prefetch, hpZ,
//!   qgZ, clipping, skip on non-finite gradients) and the analytic byte model.
//! - [`launch`](mod@launch): the door, its [`RunConfig`], the launcher
//!   detection and the two drivers (threads, MPI) over one per-rank loop.
//! - [`metrics`]: JSON Lines metrics.

mod error;

pub mod data;
pub mod model;

// Training half: configuration, optimizer, ZeRO-3/ZeRO++ step, metrics, driver.
pub mod config;
pub mod engine;
pub mod launch;
pub mod metrics;
pub mod optim;
pub mod reference;

pub use config::{EngineConfig, ZeroConfig};
pub use error::{EngineError, Result};
pub use launch::{Backend, Job, Launch, RunConfig, Started, TrainReport, launch};
pub use model::{Gpt, GptConfig, Mlp, MlpConfig, Model};

/// The README's examples, run as doc tests, so the page a registry shows stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
