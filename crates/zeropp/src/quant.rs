//! `zeropp quant`: quantize a raw f32 file or a random vector to the wire
//! format and back. All logic is in `zeropp_quant` (its `tools` module, which
//! this crate's manifest enables with the `tools` feature); this module only
//! reads arguments and prints.

use crate::CliError;
use clap::Args;
use std::path::PathBuf;
use zeropp_quant::{Bits, Options, QuantSpec, Scheme, tools};

/// Arguments of `zeropp quant`.
#[derive(Debug, Args)]
pub(crate) struct QuantArgs {
    /// Raw little-endian f32 input file (default: a random vector).
    #[arg(long, value_name = "FILE", conflicts_with = "random")]
    input: Option<PathBuf>,
    /// Number of random elements to generate when no --input is given.
    #[arg(long, value_name = "N", default_value_t = 16 * 1024 * 1024)]
    random: usize,
    /// Seed of the random vector.
    #[arg(long, value_name = "S", default_value_t = 0)]
    seed: u64,
    /// Write the wire encoding to this file.
    #[arg(long, value_name = "FILE")]
    output: Option<PathBuf>,
    /// Bits per element: 4 or 8.
    #[arg(long, default_value_t = 8)]
    bits: u32,
    /// Elements per group.
    #[arg(long, value_name = "N", default_value_t = 2048)]
    group_size: usize,
    /// Scheme: sym or asym.
    #[arg(long, default_value = "sym")]
    scheme: String,
    /// Use stochastic rounding with this seed.
    #[arg(long, value_name = "SEED")]
    stochastic: Option<u64>,
    /// Run on one thread.
    #[arg(long)]
    single_thread: bool,
}

/// Runs `zeropp quant`.
pub(crate) fn run(args: &QuantArgs) -> Result<(), CliError> {
    let spec = QuantSpec::new(Bits::from_bits(args.bits)?, args.scheme.parse::<Scheme>()?, args.group_size)?;
    let (input, source) = match &args.input {
        Some(path) => {
            let bytes =
                std::fs::read(path).map_err(|e| format!("cannot read input file {}: {e}", path.display()))?;
            (tools::f32_from_le_bytes(&bytes)?, path.display().to_string())
        }
        None => (
            tools::random_normalish(args.random, args.seed),
            format!("random normal-ish, seed {}", args.seed),
        ),
    };
    let mut opts = Options::default();
    if let Some(seed) = args.stochastic {
        opts = opts.stochastic(seed);
    }
    if args.single_thread {
        opts = opts.single_thread();
    }
    let rt = tools::round_trip(&input, spec, &opts)?;
    if let Some(path) = &args.output {
        std::fs::write(path, &rt.wire)
            .map_err(|e| format!("cannot write output file {}: {e}", path.display()))?;
    }
    println!("input:             {} elements ({source})", input.len());
    println!(
        "format:            INT{} {:?}, group size {}, {}",
        spec.bits().bits(),
        spec.scheme(),
        spec.group_size(),
        match args.stochastic {
            Some(s) => format!("stochastic rounding (seed {s})"),
            None => "round to nearest even".to_owned(),
        }
    );
    println!("wire bytes:        {}", rt.wire.len());
    println!("compression ratio: {:.3}", rt.compression_ratio);
    println!("max abs error:     {:.6e}", rt.errors.max_abs);
    println!("mean abs error:    {:.6e}", rt.errors.mean_abs);
    println!("quantize:          {:.2} GB/s", rt.quantize_gbps());
    println!("dequantize:        {:.2} GB/s", rt.dequantize_gbps());
    Ok(())
}
