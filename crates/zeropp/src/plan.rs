//! `zeropp plan`: step time, bytes and memory per GPU of each mode on a
//! cluster, as a table, as JSON (`--json`), and as an SVG of the speedup
//! against the inter-node bandwidth (`--svg`, over `--sweep`'s range).

use std::path::PathBuf;

use clap::Args;
use zeropp_run::plan::{
    Backend, Cluster, Compute, Decoder, Efficiency, GpuSpec, Overlap, Plan, PlanInput, PlanMode, PlanModel,
    Precision, Setting, Sharding, TorchMode, TorchPlanInput, parse_bandwidth, plan, plan_fsdp2,
};

use crate::CliError;
use crate::plan_report::{ClusterLine, crossings, draw, table};

/// Flags of `zeropp plan`.
#[derive(Debug, Clone, Args)]
pub(crate) struct PlanArgs {
    /// What runs the job: `engine` (zeropp's engine; a GPT) or `fsdp2`
    /// (PyTorch FSDP2 with or without zeropp.torch; a Llama-family decoder
    /// from `--model llama:...` or `--hf-config`).
    #[arg(long, default_value = "engine")]
    pub framework: String,
    /// A Hugging Face `config.json` of a Llama-family model (llama, mistral,
    /// qwen2), for `--framework fsdp2`.
    #[arg(long = "hf-config", conflicts_with = "model")]
    pub hf_config: Option<PathBuf>,
    /// `--framework fsdp2`: the dtype FSDP2 gathers the parameters in
    /// (`MixedPrecisionPolicy.param_dtype`): bf16 (the default), fp16 or fp32.
    #[arg(long = "param-dtype")]
    pub param_dtype: Option<String>,
    /// `--framework fsdp2`: the dtype it reduces the gradients in
    /// (`reduce_dtype`; default: the parameters').
    #[arg(long = "reduce-dtype")]
    pub reduce_dtype: Option<String>,
    /// `--framework fsdp2`: the root module is given `reshard_after_forward`
    /// as the layers are (`fully_shard(model, reshard_after_forward=...)`), so
    /// it reshards after its forward and gathers again in the backward. Without
    /// it, the root is FSDP2's default (`fully_shard(model)`): gathered once.
    #[arg(long = "root-reshard")]
    pub root_reshard: bool,
    /// `--framework fsdp2`: torch.distributed's backend, `nccl` (GPUs) or
    /// `gloo` (CPUs, whose reduce-scatter is an all-reduce: twice the link time);
    /// default nccl.
    #[arg(long)]
    pub backend: Option<String>,
    /// Parameters of the engine's GPT (`18e9`; default 7e9); the shape is
    /// derived from it (`--layers` and `--hidden` override).
    #[arg(long)]
    pub params: Option<f64>,
    /// A built-in GPT preset instead of `--params` and the shape flags
    /// (gpt-medium, gpt2-small, ...); `--vocab` may still replace its
    /// vocabulary, as `zeropp train` replaces it with the data's. With
    /// `--framework fsdp2`: a Llama,
    /// `llama:d=,layers=,heads=,kv_heads=,ff=,vocab=,tie=` (`d`, `layers` and
    /// `heads` required; `--seq` its context).
    #[arg(long, conflicts_with_all = ["params", "layers", "hidden"])]
    pub model: Option<String>,
    /// Transformer blocks (default: derived from `--params`).
    #[arg(long)]
    pub layers: Option<usize>,
    /// Model width (default: derived from `--params`).
    #[arg(long)]
    pub hidden: Option<usize>,
    /// Vocabulary (default: GPT-2's 50257, or the `--model` preset's).
    #[arg(long)]
    pub vocab: Option<usize>,
    /// Context: tokens per sequence (at most `--tokens`; default 2048, or a
    /// GPT preset's own).
    #[arg(long)]
    pub seq: Option<usize>,
    /// Tokens per GPU per micro-batch.
    #[arg(long, default_value_t = 2048)]
    pub tokens: usize,
    /// Nodes.
    #[arg(long, default_value_t = 16)]
    pub nodes: usize,
    /// GPUs per node.
    #[arg(long = "gpus-per-node", default_value_t = 8)]
    pub gpus_per_node: usize,
    /// Inter-node bandwidth per node (`100Gbit/s`, `400Gbps`, `50GB/s`).
    #[arg(long, default_value = "100Gbit/s")]
    pub inter: String,
    /// Intra-node bandwidth per GPU, each way (`450GB/s`). Default: the
    /// GPU's own NVLink, each way (v100 150GB/s, a100 300GB/s, h100 and h200
    /// 450GB/s); required with a custom `--gpu`.
    #[arg(long)]
    pub intra: Option<String>,
    /// Latency of one hop of a collective call, microseconds (a call routed
    /// over the rail then the node, and qgZ, take 2 hops).
    #[arg(long = "latency-us", default_value_t = 20.0)]
    pub latency_us: f64,
    /// GPU: v100, a100, h100, h200, or `tflops=T[,hbm=BANDWIDTH][,kernel=ELEMENTS_PER_S]`,
    /// or a preset with any of those replaced (`h100,kernel=1e11`). `kernel`: the
    /// quantization kernels' measured rate (the HBM bound, hbm / 3, when absent).
    #[arg(long, default_value = "h100")]
    pub gpu: String,
    /// Modes, comma-separated (the first is the speedup's baseline). The
    /// engine's: zero3, zero3-flat, zeropp, zeropp-delta, qwz, hpz, qgz
    /// (default zero3,zeropp,zeropp-delta). FSDP2's: fsdp2, fsdp2-hpz,
    /// zeropp-torch (default all three).
    #[arg(long)]
    pub mode: Option<String>,
    /// How FLOPs become seconds: `shapes` (each GEMM at the rate its shape
    /// gets on the GPU's SMs and memory, the default) or `flat` (every FLOP
    /// at `--compute-efficiency` of the peak, for a rate measured on a whole
    /// step).
    #[arg(long, default_value = "shapes")]
    pub compute: String,
    /// Achieved / peak compute (the time model's first free constant): of
    /// each GEMM tile with `--compute shapes`, of every FLOP with `flat`.
    #[arg(long = "compute-efficiency", default_value_t = Efficiency::default().compute)]
    pub compute_efficiency: f64,
    /// Achieved / nominal link bandwidth (its second).
    #[arg(long = "link-efficiency", default_value_t = Efficiency::default().link)]
    pub link_efficiency: f64,
    /// No activation checkpointing (the blocks' forward is not recomputed).
    #[arg(long = "no-checkpointing")]
    pub no_checkpointing: bool,
    /// How communication overlaps compute: `prefetch` (ZeRO's, the default),
    /// `none` (every collective adds to the step), or a measured exposed
    /// fraction of the gathers' and reduce-scatters' time, 0 to 1 (`0.8`).
    #[arg(long, default_value = "prefetch")]
    pub overlap: String,
    /// Print the plan as JSON instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Replan over a range of inter-node bandwidths: `inter=10Gbps..800Gbps`;
    /// prints where each mode's speedup over the first crosses 1.1x.
    #[arg(long)]
    pub sweep: Option<String>,
    /// Draw the speedup against the inter-node bandwidth (over `--sweep`'s
    /// range, 10Gbps..800Gbps without it) into this SVG.
    #[arg(long)]
    pub svg: Option<PathBuf>,
}

/// The cluster line of the table, from the flags.
fn cluster_line(a: &PlanArgs) -> ClusterLine<'_> {
    ClusterLine { nodes: a.nodes, gpus_per_node: a.gpus_per_node, inter: &a.inter, intra: a.intra.as_deref() }
}

/// The bandwidths a plan sweeps without `--sweep`.
const DEFAULT_SWEEP: &str = "inter=10Gbps..800Gbps";

/// The context without `--seq`.
const DEFAULT_SEQ: usize = 2048;

/// The plan of the flags at inter-node bandwidth `inter`, for the framework asked.
fn plan_at(a: &PlanArgs, inter: f64) -> Result<Plan, CliError> {
    match a.framework.as_str() {
        "engine" => {
            let torch_only = [
                ("--hf-config", a.hf_config.is_some()),
                ("--param-dtype", a.param_dtype.is_some()),
                ("--reduce-dtype", a.reduce_dtype.is_some()),
                ("--root-reshard", a.root_reshard),
                ("--backend", a.backend.is_some()),
            ];
            if let Some((flag, _)) = torch_only.iter().find(|(_, given)| *given) {
                return Err(format!("{flag} describes a PyTorch job: add --framework fsdp2").into());
            }
            Ok(plan(&input(a, inter)?)?)
        }
        "fsdp2" => Ok(plan_fsdp2(&torch_input(a, inter)?)?),
        other => Err(format!("--framework `{other}`: expected engine or fsdp2").into()),
    }
}

/// What every plan of the flags shares, at inter-node bandwidth `inter`.
fn setting(a: &PlanArgs, inter: f64) -> Result<Setting, CliError> {
    let gpu = GpuSpec::parse(&a.gpu)?;
    Ok(Setting {
        tokens: a.tokens,
        cluster: Cluster {
            nodes: a.nodes,
            gpus_per_node: a.gpus_per_node,
            inter_bytes_per_s: inter,
            intra_bytes_per_s: intra(a, &gpu)?,
            latency_s: a.latency_us * 1e-6,
        },
        gpu,
        compute: Compute::parse(&a.compute)?,
        efficiency: Efficiency { compute: a.compute_efficiency, link: a.link_efficiency },
        checkpointing: !a.no_checkpointing,
        overlap: Overlap::parse(&a.overlap)?,
    })
}

/// A PyTorch job's plan input from the flags.
fn torch_input(a: &PlanArgs, inter: f64) -> Result<TorchPlanInput, CliError> {
    let decoder = match (&a.hf_config, &a.model) {
        (Some(path), _) => {
            let text =
                std::fs::read_to_string(path).map_err(|e| format!("--hf-config {}: {e}", path.display()))?;
            Decoder::from_hf_config(&text, a.seq.unwrap_or(DEFAULT_SEQ))?
        }
        (None, Some(spec)) => Decoder::from_spec(spec, a.seq.unwrap_or(DEFAULT_SEQ))?.ok_or_else(|| {
            format!("--model `{spec}`: --framework fsdp2 plans a Llama, llama:d=...,layers=...")
        })?,
        (None, None) => {
            return Err(
                "--framework fsdp2 needs the model: --hf-config config.json or --model llama:d=...".into()
            );
        }
    };
    if a.params.is_some() || a.layers.is_some() || a.hidden.is_some() || a.vocab.is_some() {
        return Err(
            "--params, --layers, --hidden and --vocab shape the engine's GPT; a Llama's shape is in \
                    --model llama:... or --hf-config"
                .into(),
        );
    }
    let modes = a
        .mode
        .as_deref()
        .unwrap_or("fsdp2,fsdp2-hpz,zeropp-torch")
        .split(',')
        .map(TorchMode::parse)
        .collect::<Result<Vec<_>, _>>()?;
    let param_bytes = Precision::dtype_bytes(a.param_dtype.as_deref().unwrap_or("bf16"))
        .map_err(|e| format!("--param-dtype: {e}"))?;
    let reduce_bytes = match &a.reduce_dtype {
        Some(d) => Precision::dtype_bytes(d).map_err(|e| format!("--reduce-dtype: {e}"))?,
        None => param_bytes,
    };
    Ok(TorchPlanInput {
        decoder,
        setting: setting(a, inter)?,
        sharding: Sharding {
            precision: Precision { param_bytes, reduce_bytes },
            root_reshards: a.root_reshard,
            backend: Backend::parse(a.backend.as_deref().unwrap_or("nccl"))?,
        },
        modes,
    })
}

/// The plan's input from the flags, at inter-node bandwidth `inter`.
fn input(a: &PlanArgs, inter: f64) -> Result<PlanInput, CliError> {
    let model = match &a.model {
        Some(name) => {
            if a.seq.is_some() {
                return Err(format!("--seq: the preset `{name}` has its own context").into());
            }
            let g = zeropp_engine::model::GptConfig::preset(name)
                .ok_or_else(|| format!("--model `{name}`: not a GPT preset"))?;
            match a.vocab {
                Some(v) => PlanModel { gpt: g }.with_vocab(v)?,
                None => PlanModel { gpt: g },
            }
        }
        None => {
            let vocab = a.vocab.unwrap_or(PlanModel::DEFAULT_VOCAB);
            let derived =
                PlanModel::from_params(a.params.unwrap_or(7e9), vocab, a.seq.unwrap_or(DEFAULT_SEQ))?;
            PlanModel::shaped(
                a.layers.unwrap_or(derived.gpt.n_layer),
                a.hidden.unwrap_or(derived.gpt.d_model),
                vocab,
                a.seq.unwrap_or(DEFAULT_SEQ),
            )?
        }
    };
    let modes = a
        .mode
        .as_deref()
        .unwrap_or("zero3,zeropp,zeropp-delta")
        .split(',')
        .map(PlanMode::parse)
        .collect::<Result<Vec<_>, _>>()?;
    Ok(PlanInput { model, setting: setting(a, inter)?, modes })
}

/// `--intra`'s rate in bytes/s, or the GPU's own NVLink when it is not given.
fn intra(a: &PlanArgs, gpu: &GpuSpec) -> Result<f64, CliError> {
    match &a.intra {
        Some(v) => Ok(parse_bandwidth(v).map_err(|e| format!("--intra: {e}"))?),
        None => gpu.nvlink_bytes_per_s().ok_or_else(|| {
            format!("--gpu `{}` names no NVLink: give the intra-node rate with --intra (450GB/s)", a.gpu)
                .into()
        }),
    }
}

/// `--sweep inter=A..B`'s range in bytes/s.
fn sweep_range(s: &str) -> Result<(f64, f64), CliError> {
    let bad = || format!("--sweep `{s}`: expected inter=LOW..HIGH, e.g. inter=10Gbps..800Gbps");
    let range = s.strip_prefix("inter=").ok_or_else(bad)?;
    let (lo, hi) = range.split_once("..").ok_or_else(bad)?;
    let bw = |x: &str| parse_bandwidth(x).map_err(|e| format!("--sweep `{s}`: {e}"));
    let (lo, hi) = (bw(lo)?, bw(hi)?);
    if lo >= hi {
        return Err(bad().into());
    }
    Ok((lo, hi))
}

/// Runs `zeropp plan`.
pub(crate) fn run(a: &PlanArgs) -> Result<(), CliError> {
    let inter = parse_bandwidth(&a.inter).map_err(|e| format!("--inter: {e}"))?;
    let p = plan_at(a, inter)?;
    if a.sweep.is_none() && a.svg.is_none() {
        if a.json {
            println!("{}", serde_json::to_string_pretty(&p)?);
        } else {
            print!("{}", table(&p, &cluster_line(a)));
            if p.framework == "fsdp2" && p.order.len() > 1 {
                // A PyTorch user's question: below which bandwidth does zeropp.torch pay?
                let (lo, hi) = sweep_range(DEFAULT_SWEEP)?;
                print!("{}", crossings(&p.order, &sweep(a, lo, hi)?));
            }
        }
        return Ok(());
    }
    let (lo, hi) = sweep_range(a.sweep.as_deref().unwrap_or(DEFAULT_SWEEP))?;
    let points = sweep(a, lo, hi)?;
    if a.json {
        // The plan, plus `sweep`: each bandwidth's speedup per mode.
        let mut v = serde_json::to_value(&p)?;
        let sweep: Vec<serde_json::Value> = points
            .iter()
            .map(|(bw, q)| {
                let speedups: serde_json::Map<String, serde_json::Value> =
                    q.modes.iter().map(|(k, m)| (k.clone(), m.speedup.into())).collect();
                serde_json::json!({ "inter_bytes_per_s": bw, "speedup": speedups })
            })
            .collect();
        if let Some(o) = v.as_object_mut() {
            o.insert("sweep".into(), sweep.into());
        }
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print!("{}", table(&p, &cluster_line(a)));
        print!("{}", crossings(&p.order, &points));
    }
    if let Some(path) = &a.svg {
        draw(path, &p.order, &points).map_err(|e| format!("{}: {e}", path.display()))?;
        if !a.json {
            println!("wrote {}", path.display());
        }
    }
    Ok(())
}

/// The plan at 41 inter-node bandwidths, log-spaced from `lo` to `hi`.
fn sweep(a: &PlanArgs, lo: f64, hi: f64) -> Result<Vec<(f64, Plan)>, CliError> {
    const POINTS: usize = 41;
    (0..POINTS)
        .map(|i| {
            let bw = lo * (hi / lo).powf(i as f64 / (POINTS - 1) as f64);
            Ok((bw, plan_at(a, bw)?))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The error of `zeropp plan ARGS` at 100 Gbit/s, or "" when it plans.
    fn refusal(args: &[&str]) -> String {
        use clap::Parser;
        let words = ["zeropp", "plan"].iter().chain(args).copied();
        match crate::Cli::try_parse_from(words).map(|c| c.command) {
            Ok(crate::Command::Plan(a)) => {
                plan_at(&a, 12.5e9).err().map(|e| e.to_string()).unwrap_or_default()
            }
            Ok(_) => "not a plan".into(),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn each_frameworks_flags_are_refused_in_the_other() {
        let llama = ["--framework", "fsdp2", "--model", "llama:d=64,layers=2,heads=4"];
        for (args, says) in [
            (&["--backend", "gloo"][..], "--backend describes a PyTorch job"),
            (&["--param-dtype", "fp32"][..], "--param-dtype describes a PyTorch job"),
            (&["--reduce-dtype", "fp32"][..], "--reduce-dtype describes a PyTorch job"),
            (&["--root-reshard"][..], "--root-reshard describes a PyTorch job"),
            (&[&llama[..], &["--vocab", "10"]].concat()[..], "--vocab shape the engine's GPT"),
            (&[&llama[..], &["--backend", "mpi"]].concat()[..], "expected nccl or gloo"),
        ] {
            let e = refusal(args);
            assert!(e.contains(says), "{args:?}: `{e}`");
        }
        assert_eq!(refusal(&llama), "");
        assert_eq!(refusal(&["--params", "1e9"]), "");
    }

    #[test]
    fn sweeps_read_a_bandwidth_range() {
        assert_eq!(sweep_range("inter=10Gbps..800Gbps").ok(), Some((1.25e9, 100e9)));
        for bad in ["10Gbps..800Gbps", "inter=800Gbps..10Gbps", "inter=10Gbps", "inter=a..b"] {
            assert!(sweep_range(bad).is_err(), "{bad}");
        }
    }
}
