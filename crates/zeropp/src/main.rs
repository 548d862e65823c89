//! `zeropp`: the command-line front end. Each subcommand lives in its own
//! module; this file only parses and dispatches.

use clap::{Parser, Subcommand};
use std::process::ExitCode;

mod checkpoint;
mod compare;
mod config;
#[cfg(test)]
mod doc_lines;
mod error;
mod models;
mod plan;
mod plan_report;
mod print;
mod quant;
#[cfg(test)]
mod test_util;
mod train;

pub(crate) use error::CliError;

/// ZeRO++ in Rust: quantized collectives, training and tools.
#[derive(Debug, Parser)]
#[command(name = "zeropp", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
enum Command {
    /// Quantize a vector to the wire format and back; report error,
    /// compression and throughput.
    Quant(quant::QuantArgs),
    /// Inspect or export a sharded checkpoint.
    Checkpoint(checkpoint::CheckpointArgs),
    /// Train a model with ZeRO-3 / ZeRO++ on simulated nodes.
    Train(Box<config::TrainArgs>),
    /// Run ZeRO-3, ZeRO++ and each technique alone on one workload, side by side.
    Compare(compare::CompareArgs),
    /// Predict step time, bytes and memory per GPU of ZeRO-3, ZeRO++ and
    /// zeropp-delta on a cluster of any size, without running.
    Plan(Box<plan::PlanArgs>),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result: Result<(), CliError> = match cli.command {
        Command::Quant(args) => quant::run(&args),
        Command::Checkpoint(args) => checkpoint::run(&args),
        Command::Train(args) => {
            // Training allocates per op (candle's Llama most): keep freed memory.
            zeropp_candle::alloc::retain_freed_memory();
            train::run(&args)
        }
        Command::Plan(args) => plan::run(&args),
        Command::Compare(args) => {
            zeropp_candle::alloc::retain_freed_memory();
            compare::run(&args)
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
