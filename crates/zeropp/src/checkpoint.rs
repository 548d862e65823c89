//! `zeropp checkpoint`: inspect and export sharded checkpoints. All logic
//! (verification, consolidation, streamed export) is in `zeropp_partition`; this
//! module only reads arguments and prints.

use crate::CliError;
use clap::{Args, Subcommand};
use std::path::PathBuf;
use zeropp_partition::{CheckpointReader, load_checkpoint};

/// Arguments of `zeropp checkpoint`.
#[derive(Debug, Args)]
pub(crate) struct CheckpointArgs {
    #[command(subcommand)]
    command: CheckpointCommand,
}

/// The `zeropp checkpoint` subcommands.
#[derive(Debug, Subcommand)]
enum CheckpointCommand {
    /// Verify a checkpoint (manifest and every shard checksum) and print its
    /// topology, step, files and buckets.
    Inspect {
        /// Checkpoint root (follows LATEST) or a step-N folder.
        dir: PathBuf,
    },
    /// Verify a checkpoint and write its master weights as one consolidated
    /// safetensors file (tensors named by parameter, padding stripped).
    Export {
        /// Checkpoint root (follows LATEST) or a step-N folder.
        dir: PathBuf,
        /// Output `.safetensors` file.
        out: PathBuf,
    },
}

/// Runs `zeropp checkpoint`.
pub(crate) fn run(args: &CheckpointArgs) -> Result<(), CliError> {
    match &args.command {
        CheckpointCommand::Inspect { dir } => inspect(dir),
        CheckpointCommand::Export { dir, out } => export(dir, out),
    }
}

fn inspect(dir: &std::path::Path) -> Result<(), CliError> {
    let ck = load_checkpoint(dir)?;
    let m = ck.reader().manifest();
    let params: usize = m.buckets.iter().map(|b| b.numel).sum();
    let padded: usize = m.buckets.iter().map(|b| b.padded_len).sum();
    println!("checkpoint {} (format v{})", ck.reader().dir().display(), m.format_version);
    println!("step: {}", m.step);
    println!(
        "topology: world {} = {} nodes x {} ranks/node; align {}; hpz {}",
        m.topology.world, m.topology.nodes, m.topology.local_size, m.align, m.hpz
    );
    println!("parameters: {params} ({padded} padded) in {} buckets", m.buckets.len());
    println!(
        "shards: {} files, {} bytes, all checksums verified (crc32c)",
        m.shards.len(),
        m.total_shard_bytes()
    );
    println!("user config: {}", m.user_config);
    println!();
    println!("{:>5}  {:<36} {:>12}  {:>8}", "rank", "file", "bytes", "crc32c");
    for s in &m.shards {
        println!("{:>5}  {:<36} {:>12}  {:08x}", s.rank, s.file, s.size, s.crc32c);
    }
    println!();
    println!(
        "{:>6}  {:<24} {:>6} {:>12} {:>12} {:>8} {:>12}",
        "bucket", "name", "params", "numel", "padded", "step", "master_l2"
    );
    for (i, (layout, full)) in m.buckets.iter().zip(ck.buckets()).enumerate() {
        let l2 = full.master.iter().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>().sqrt();
        println!(
            "{i:>6}  {:<24} {:>6} {:>12} {:>12} {:>8} {l2:>12.4e}",
            layout.name,
            layout.params.len(),
            layout.numel,
            layout.padded_len,
            full.step
        );
    }
    Ok(())
}

fn export(dir: &std::path::Path, out: &std::path::Path) -> Result<(), CliError> {
    // Streamed: verifies every shard file, then writes tensor by tensor
    // without holding the model.
    let ck = CheckpointReader::open(dir)?;
    let size = ck.export_safetensors(out)?;
    let tensors: usize = ck.manifest().buckets.iter().map(|b| b.params.len()).sum();
    let params: usize = ck.manifest().buckets.iter().map(|b| b.numel).sum();
    println!(
        "exported {tensors} tensors ({params} parameters) from step {} to {} ({size} bytes)",
        ck.step(),
        out.display()
    );
    Ok(())
}
