//! ZeRO-3 and ZeRO++ for any [candle](https://github.com/huggingface/candle)
//! model: the engine's [`Model`](zeropp_engine::Model) on candle stages.
//!
//! You write the stages with ordinary candle-nn code; each stage is one gather
//! unit, whose weights the engine shards over the ranks and gathers (qwZ INT8,
//! hpZ) only while the stage runs, and whose gradients it reduces (qgZ INT4).
//! Backward recomputes a stage from its input by default, so a stage's full
//! weights never outlive the engine's gather ([`model`] explains the protocol).
//!
//! ```
//! use candle_nn::Module;
//! use zeropp_candle::CandleModel;
//! use zeropp_engine::data::TextDataset;
//! use zeropp_engine::{RunConfig, launch};
//!
//! let (vocab, d) = (16, 16);
//! let model = CandleModel::builder("mlp-lm", vocab, 8)
//!     .stage("embed", move |vb, ids| candle_nn::embedding(vocab, d, vb)?.forward(ids))
//!     .stage("block", move |vb, x| x + candle_nn::linear(d, d, vb.pp("fc"))?.forward(x)?.tanh()?)
//!     .stage("head", move |vb, x| candle_nn::linear(d, vocab, vb)?.forward(x))
//!     .build()?;
//! let tokens: Vec<u32> = (0..4000u32).map(|i| (i * 5 + i / 3) % vocab as u32).collect();
//! let data = TextDataset::from_tokens(vocab, tokens, 0.1)?;
//! // ZeRO++ (qwZ + hpZ + qgZ) on 2 simulated nodes x 2 ranks.
//! let report = launch(&model, &data, &RunConfig::tiny().with_steps(10))?;
//! assert!(report.steps[9].loss < report.steps[0].loss);
//! # Ok::<(), zeropp_candle::CandleError>(())
//! ```
//!
//! [`LlamaConfig`] builds a Llama-style decoder this way (RMSNorm, RoPE,
//! SwiGLU, grouped-query attention) with Hugging Face's tensor names, so its
//! checkpoints load into candle-transformers' Llama.

pub mod alloc;
mod error;
pub mod llama;
pub mod model;
pub mod nn;
pub mod ops;
mod params;

pub use error::{CandleError, Result};
pub use llama::LlamaConfig;
pub use model::{CandleModel, CandleModelBuilder, CandleTape, DEFAULT_KEEP_GRAPH_BYTES, StageContext};

/// The candle crates this adapter is built on (pinned versions), for users who
/// want exactly the types the stages see.
pub use {candle_core, candle_nn};
