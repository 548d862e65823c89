//! The integration tests of the `zeropp` binary, in one test binary (one link
//! instead of one per file): a module per subcommand.
//!
//! - `cli`: `zeropp quant`;
//! - `checkpoint_cli`: `zeropp checkpoint inspect | export`;
//! - `train_cli`: `zeropp train` (metrics, world-size independence, failures, resume);
//! - `compare_cli`: `zeropp compare` (the table against the hierarchical baseline, the plots);
//! - `plan_cli`: `zeropp plan` (its JSON, table, sweep and SVG, bad flags).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a test failure

mod checkpoint_cli;
mod cli;
mod compare_cli;
mod plan_cli;
mod train_cli;
