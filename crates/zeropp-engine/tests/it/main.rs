//! The integration tests of `zeropp-engine`, in one test binary (one link
//! instead of one per file): a module per area.
//!
//! - `models`: gradients, determinism and kernels of the built-in models;
//! - `model_data`: the Markov source, the text dataset and batch sharding.
//!
//! The engine's runs (the ZeRO-3 / ZeRO++ step, bytes, checkpoints, faults,
//! fidelity) are tested through the run layer that builds them, in
//! `crates/zeropp-run/tests/it`.
//!
//! Proptest failure seeds persist next to the module that found them
//! (`tests/it/<module>.proptest-regressions`); commit them when they appear.
//! Timings are benches (`benches/model_timing.rs`), not tests.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may unwrap: a panic is a test failure

mod model_data;
mod models;
