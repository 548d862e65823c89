//! The built-in run behind `zeropp train`: a [`TrainConfig`] picks one of the
//! built-in models ([`ModelChoice`]: the engine's GPT or MLP, or
//! zeropp-candle's Llama) and a source of text
//! ([`zeropp_engine::data::DataChoice`]) for a [`RunConfig`];
//! [`TrainConfig::build`] makes them, and [`train`] runs them through the
//! engine's one door, [`Launch`].
//!
//! A model or data of your own needs none of this: call
//! [`zeropp_engine::launch()`] with them and a [`RunConfig`].

use zeropp_engine::data::{DataChoice, DataInfo, TextDataset, load_data};
use zeropp_engine::engine::memory::MemoryPrediction;
use zeropp_engine::engine::tags;
use zeropp_engine::launch::{Launch, RunConfig, TrainReport, memory_prediction};
use zeropp_engine::model::Either;
use zeropp_engine::{Gpt, GptConfig, Mlp, MlpConfig};

use crate::RunError;
use crate::llama::LlamaShape;
use crate::model::RunModel;

/// Which built-in model to train (its vocabulary is set from the data).
#[derive(Debug, Clone, PartialEq)]
pub enum ModelChoice {
    /// The engine's character-level GPT.
    Gpt(GptConfig),
    /// The engine's context-window MLP language model.
    Mlp(MlpConfig),
    /// zeropp-candle's Llama decoder (RMSNorm, RoPE, SwiGLU, grouped-query
    /// attention; Hugging Face names), of this shape.
    Llama(LlamaShape),
}

impl ModelChoice {
    /// The model named by `spec`, as `zeropp train --model` reads it: a name
    /// the caller resolves itself (`Ok(None)`), or `llama[:KEY=VALUE,...]`
    /// (see [`LlamaShape::parse`]).
    pub fn llama(spec: &str) -> Result<Option<Self>, RunError> {
        Ok(LlamaShape::parse(spec)?.map(Self::Llama))
    }

    /// The model, with the vocabulary `vocab`.
    pub fn build(&self, vocab: usize) -> Result<RunModel, RunError> {
        Ok(match self {
            Self::Gpt(g) => Either::Left(Either::Left(Gpt::new(g.with_vocab(vocab))?)),
            Self::Mlp(m) => Either::Left(Either::Right(Mlp::new(m.with_vocab(vocab))?)),
            Self::Llama(s) => Either::Right(s.build(vocab)?),
        })
    }
}

/// A run of a built-in model on built-in data: what `zeropp train` runs.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainConfig {
    /// The model.
    pub model: ModelChoice,
    /// The data.
    pub data: DataChoice,
    /// The run: cluster, engine, schedule, checkpoints, metrics.
    pub run: RunConfig,
}

impl Default for TrainConfig {
    /// `zeropp train` with no arguments: the default GPT on generated Markov
    /// text, [`RunConfig::default`] (full ZeRO++ on 8 ranks as 2 nodes x 4).
    fn default() -> Self {
        Self {
            model: ModelChoice::Gpt(GptConfig::default_small()),
            data: DataChoice::Markov { seed: 0, chars: 200_000 },
            run: RunConfig::default(),
        }
    }
}

impl TrainConfig {
    /// A small, fast configuration (the tiny GPT on a short Markov text,
    /// [`RunConfig::tiny`]) for examples and tests.
    pub fn tiny() -> Self {
        Self {
            model: ModelChoice::Gpt(GptConfig::tiny()),
            data: DataChoice::Markov { seed: 1, chars: 20_000 },
            run: RunConfig::tiny(),
        }
    }

    /// This configuration with `steps` optimizer steps.
    pub fn with_steps(mut self, steps: usize) -> Self {
        self.run.steps = steps;
        self
    }

    /// The model, the data and its description, as the run trains them (the
    /// model's vocabulary is the data's).
    pub fn build(&self) -> Result<(RunModel, TextDataset, DataInfo), RunError> {
        let (data, info) = load_data(&self.data)?;
        let model = self.model.build(data.vocab_size())?;
        Ok((model, data, info))
    }

    /// The memory model's per-rank prediction for this run (see
    /// [`zeropp_engine::engine::memory`]).
    pub fn memory_prediction(&self) -> Result<MemoryPrediction, RunError> {
        let (model, _, _) = self.build()?;
        Ok(memory_prediction(&model, &self.run)?)
    }
}

/// Trains as configured: [`TrainConfig::build`], then [`Launch`] with the
/// data's description.
///
/// ```
/// use zeropp_run::train::{ModelChoice, TrainConfig, train};
/// let report = train(&TrainConfig::tiny().with_steps(3))?;
/// assert_eq!(report.steps.len(), 3);
/// assert!(report.summary.final_loss.is_finite());
/// assert_eq!(report.summary.mode, "zeropp");
/// // Measured bytes equal the analytic model.
/// assert_eq!(report.summary.bytes_per_step, report.summary.model_bytes_per_step);
/// // The candle Llama is one more choice of the same run.
/// let llama = ModelChoice::llama("llama:d=16,layers=1,heads=2,kv_heads=1,seq=16")?.ok_or("a llama")?;
/// let cfg = TrainConfig { model: llama, ..TrainConfig::tiny().with_steps(1) };
/// assert_eq!(train(&cfg)?.steps.len(), 1);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn train(cfg: &TrainConfig) -> Result<TrainReport, RunError> {
    let (model, data, info) = cfg.build()?;
    Ok(Launch::new(&model, &data, &cfg.run).describe(info).run()?)
}

/// The tags the engine uses, in display order.
pub const OP_TAGS: [&str; 5] =
    [tags::FWD_GATHER, tags::BWD_GATHER, tags::GRAD_REDUCE, tags::GRAD_NORM, tags::OTHER];
