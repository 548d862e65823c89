//! The engine's runs, tested through the run layer that builds them
//! ([`zeropp_run::train::TrainConfig`]), in one test binary (one link instead
//! of one per file): a module per area.
//!
//! - the public API for a model of your own: `engine_api`;
//! - the training engine: `engine_equivalence`, `engine_bytes`,
//!   `engine_checkpoint`, `engine_delta`, `engine_faults`, `engine_knobs`,
//!   `engine_scale`, `engine_zeropp_options` (INT8 hpZ wire, 1-D exclusion,
//!   routing), `engine_fidelity` (needs `../shared/data/tinyshakespeare.txt`,
//!   found by `zeropp_tests::data`);
//! - the run layer itself: `run_models` (every [`ModelChoice`], the candle
//!   Llama included, through one `train`), `plan` (the planner's bytes against
//!   a run's counters, its time model's invariants).
//!
//! Proptest failure seeds persist next to the module that found them
//! (`tests/it/<module>.proptest-regressions`); commit them when they appear.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may unwrap: a panic is a test failure

mod engine_api;
mod engine_bytes;
mod engine_checkpoint;
mod engine_delta;
mod engine_equivalence;
mod engine_faults;
mod engine_fidelity;
mod engine_knobs;
mod engine_scale;
mod engine_zeropp_options;
mod plan;
mod run_models;

use zeropp_engine::RunConfig;
use zeropp_engine::config::{EngineConfig, ZeroConfig};
use zeropp_engine::data::DataChoice;
use zeropp_engine::model::GptConfig;
use zeropp_run::train::{ModelChoice, TrainConfig};

/// The tiny GPT on the seed-3 Markov text on `world` ranks of `local` per
/// node, parameters kept: the run the engine tests vary (each sets its steps,
/// evaluation and engine).
fn tiny_gpt_run(world: usize, local: usize, engine: EngineConfig) -> TrainConfig {
    TrainConfig {
        model: ModelChoice::Gpt(GptConfig::tiny()),
        data: DataChoice::Markov { seed: 3, chars: 20_000 },
        run: RunConfig { world, local_size: local, engine, keep_params: true, ..RunConfig::default() },
    }
}

/// `model` on the seed-6 Markov text on `world` ranks of `local` per node,
/// one sequence per rank and micro-batch with `accum` micro-batches a step,
/// no evaluation, parameters kept: the runs whose bytes and copies are checked.
fn accum_run(
    world: usize,
    local: usize,
    zero: ZeroConfig,
    accum: usize,
    steps: usize,
    model: ModelChoice,
) -> TrainConfig {
    TrainConfig {
        model,
        data: DataChoice::Markov { seed: 6, chars: 30_000 },
        run: RunConfig {
            world,
            local_size: local,
            engine: EngineConfig {
                zero,
                global_batch: world * accum,
                grad_accum: accum,
                ..EngineConfig::default()
            },
            steps,
            eval_batches: 0,
            keep_params: true,
            ..RunConfig::default()
        },
    }
}
