//! zeropp-quant's integration tests, in one binary (one link, one process),
//! with a module per area. `common` is the independent reference
//! implementation and proptest strategies the property tests share.
//!
//! Proptest failures persist next to the module that found them
//! (`properties.proptest-regressions` beside `properties.rs`), as they did
//! when each file was its own test binary: see [`common::config`].

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a test failure

mod common;

mod api;
#[cfg(feature = "cuda")]
mod gpu;
#[cfg(feature = "cuda")]
mod gpu_cases;
#[cfg(feature = "cuda")]
mod gpu_emu;
mod hadamard;
mod int4;
mod non_finite;
mod properties;
mod stochastic;
mod tools;
mod vectors;
mod wire;
