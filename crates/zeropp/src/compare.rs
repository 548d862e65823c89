//! `zeropp compare`: ZeRO-3, ZeRO++ and each technique alone on one workload.

use std::path::PathBuf;

use clap::Args;
use zeropp_engine::compare::{compare, standard_variants};
use zeropp_engine::config::ZeroConfig;

use crate::CliError;
use crate::train::{RunArgs, build_config, progress_bar};

/// Flags of `zeropp compare`.
#[derive(Debug, Clone, Args)]
pub(crate) struct CompareArgs {
    #[command(flatten)]
    pub run: RunArgs,
    /// Only ZeRO-3 and full ZeRO++ (skip the single-technique ablations).
    #[arg(long = "no-ablation")]
    pub no_ablation: bool,
    /// Directory of the SVG plots (loss.svg, bytes.svg).
    #[arg(long = "out", default_value = "zeropp-compare")]
    pub out: PathBuf,
}

/// Runs `zeropp compare`.
pub(crate) fn run(args: &CompareArgs) -> Result<(), CliError> {
    let (cfg, warnings) = build_config(&args.run, ZeroConfig::zero3())?;
    for w in &warnings {
        eprintln!("warning: DeepSpeed config: {w}");
    }
    let mut variants = standard_variants(&cfg.engine.zero, cfg.local_size);
    if args.no_ablation {
        variants.retain(|v| v.name == "zero3" || v.name == "zeropp");
    }
    let bars: Vec<_> = variants.iter().map(|v| progress_bar(cfg.steps, &format!("{:>7}", v.name))).collect();
    let result = compare(&cfg, &variants, &mut |i, r| {
        if let Some(pb) = bars.get(i) {
            pb.set_position(r.step as u64 + 1);
            pb.set_message(format!("loss {:.4} | {:.4} s/step", r.loss, r.step_time_s));
            if r.step + 1 == cfg.steps {
                pb.finish();
            }
        }
    })?;
    println!();
    print!("{}", result.table());
    let plots = result.write_plots(&args.out)?;
    for p in plots {
        println!("wrote {}", p.display());
    }
    Ok(())
}
