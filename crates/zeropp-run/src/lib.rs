//! # zeropp-run
//!
//! The run layer of zeropp, above the engine and zeropp-candle: what the
//! `zeropp` command runs when it names a built-in model instead of bringing
//! its own.
//!
//! - [`train`](mod@train): a [`TrainConfig`](train::TrainConfig) names a
//!   built-in model ([`ModelChoice`](train::ModelChoice): the engine's GPT or
//!   MLP, or zeropp-candle's Llama) and a source of text, and
//!   [`train()`](train::train) runs it through the engine's one door,
//!   [`zeropp_engine::Launch`]. [`RunModel`] is any of those models as one
//!   [`zeropp_engine::Model`].
//! - [`compare`]: ZeRO-3, ZeRO++ and each ZeRO++ technique alone on one
//!   workload, side by side (the records; the CLI draws them).
//! - [`deepspeed`]: a DeepSpeed JSON configuration read into the engine's
//!   [`EngineConfig`](zeropp_engine::EngineConfig), with a warning for each
//!   key that has no effect here.
//! - [`llama`]: the candle Llama's shape as a run names it.
//! - [`plan`](mod@plan): step time, bytes and memory per GPU of every mode on
//!   any cluster, from the engine's byte and memory models (`zeropp plan`).
//!
//! A model or data of your own needs none of this: call
//! [`zeropp_engine::launch()`] (or `zeropp_candle`'s builder for a candle
//! model) directly.
//!
//! ```
//! use zeropp_run::train::{TrainConfig, train};
//! let report = train(&TrainConfig::tiny().with_steps(2))?;
//! assert_eq!(report.steps.len(), 2);
//! # Ok::<(), zeropp_run::RunError>(())
//! ```

mod error;
mod model;

pub mod compare;
pub mod deepspeed;
pub mod llama;
pub mod plan;
pub mod train;

pub use error::{Result, RunError};
pub use model::{NativeModel, RunModel};
