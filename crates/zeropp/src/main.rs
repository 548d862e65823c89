//! `zeropp`: the command-line front end. Each subcommand lives in its own
//! module; this file only parses and dispatches.

use clap::{Parser, Subcommand};
use std::process::ExitCode;

mod checkpoint;
mod compare;
mod config;
mod llama;
mod models;
mod print;
mod quant;
mod train;

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
}

/// Errors from any subcommand, printed as one line.
type CliError = Box<dyn std::error::Error + Send + Sync>;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result: Result<(), CliError> = match cli.command {
        Command::Quant(args) => quant::run(&args),
        Command::Checkpoint(args) => checkpoint::run(&args),
        Command::Train(args) => train::run(&args),
        Command::Compare(args) => compare::run(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Helpers of the unit tests of more than one module.
#[cfg(test)]
mod test_util {
    /// Asserts that `parse` refuses every `(spec, says)` of `cases` with an
    /// error whose message contains `says`.
    pub(crate) fn refused<T>(parse: impl Fn(&str) -> Result<T, crate::CliError>, cases: &[(&str, &str)]) {
        for (spec, says) in cases {
            let err = parse(spec).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(err.contains(says), "{spec}: {err}");
        }
    }
}
