//! The setup the gradient probes share (`loco_probe`, `qgz_error`): the
//! training text by name, the default small GPT on its vocabulary, the 2 × 4
//! cluster of thread ranks, and the phases of training they report on.
//! (Cargo builds an example from each file of `examples/`, not from its
//! folders, so this one is a module of both.)

use std::path::PathBuf;

use zeropp_comm::collectives::{DenseWire, Reduce, Routing, world_all_gather, world_reduce_scatter};
use zeropp_comm::{Communicator, ThreadCluster, ThreadComm, ThreadOptions, Topology};
use zeropp_engine::config::{EngineConfig, ZeroConfig};
use zeropp_engine::data::TextDataset;
use zeropp_engine::data::{DataChoice, load_data};
use zeropp_engine::engine::build_plan;
use zeropp_engine::model::init_params;
use zeropp_engine::optim::{AdamW, clip_factor};
use zeropp_engine::{EngineError, Gpt, GptConfig, Model};
use zeropp_partition::{BucketLayout, PartitionPlan};

/// Nodes of the probes' cluster.
pub(crate) const NODES: usize = 2;
/// Ranks per node.
pub(crate) const LOCAL: usize = 4;
/// Sequences per global batch.
pub(crate) const BATCH: usize = 16;

/// The flags both probes take.
pub(crate) struct Args {
    /// `--data`: `generated`, `shakespeare` or a file (see [`setup`]).
    pub(crate) data: String,
    /// `--steps`: training steps.
    pub(crate) steps: usize,
    /// `--seed`: the parameters' and the batches' seed.
    pub(crate) seed: u64,
    /// `--out`: also write the report to this file.
    pub(crate) out: Option<PathBuf>,
}

/// Reads the command line: the common flags (defaults: `generated`, `steps`
/// steps, seed 1), and every other flag with its value through `other`, which
/// returns false for a flag it does not know. Aborts on an unknown flag or a
/// missing value. (`--bench`, which `cargo bench` passes, is ignored.)
pub(crate) fn parse_args(steps: usize, mut other: impl FnMut(&str, String) -> bool) -> Args {
    let mut a = Args { data: "generated".into(), steps, seed: 1, out: None };
    let mut it = std::env::args().skip(1).filter(|k| k != "--bench");
    while let Some(k) = it.next() {
        let v = it.next().unwrap_or_else(|| panic!("{k} needs a value"));
        match k.as_str() {
            "--data" => a.data = v,
            "--steps" => a.steps = v.parse().expect("--steps N"),
            "--seed" => a.seed = v.parse().expect("--seed N"),
            "--out" => a.out = Some(PathBuf::from(v)),
            flag => assert!(other(flag, v), "unknown argument {flag}; see the example's docs"),
        }
    }
    a
}

/// What a probe trains on: the text and the default small GPT with the
/// text's vocabulary, on the probes' cluster.
pub(crate) struct Setup {
    /// The training text.
    pub(crate) data: TextDataset,
    /// The default small GPT with the text's vocabulary.
    pub(crate) model: Gpt,
    /// [`NODES`] × [`LOCAL`] ranks.
    pub(crate) topology: Topology,
    /// Ranks in all.
    pub(crate) world: usize,
    /// The model's sequence length.
    pub(crate) seq: usize,
    /// The model's layers (one bucket each).
    pub(crate) layers: usize,
    /// The text, the model and the cluster in words, for the probes' banners.
    pub(crate) banner: String,
    /// The engine configuration the probe mirrors.
    pub(crate) cfg: EngineConfig,
    /// The model's partition on the cluster under `cfg`.
    pub(crate) plan: PartitionPlan,
}

/// `--data`'s text (`generated`: the Markov corpus of `zeropp train`;
/// `shakespeare`: `../shared/data/tinyshakespeare.txt`; else a file) and the
/// default small GPT, cluster and partition under `zero` on it. Aborts with the
/// reason when the text is missing.
pub(crate) fn setup(data: &str, zero: ZeroConfig) -> Setup {
    setup_gpt(data, zero, GptConfig::default_small(), LOCAL)
}

/// [`setup`] with the GPT of shape `gpt` (its vocabulary set from the text) on
/// [`NODES`] nodes of `local` ranks.
pub(crate) fn setup_gpt(data: &str, zero: ZeroConfig, gpt: GptConfig, local: usize) -> Setup {
    let choice = match data {
        "generated" => DataChoice::Markov { seed: 0, chars: 200_000 },
        "shakespeare" => DataChoice::File(
            zeropp_tests::data::find(zeropp_tests::data::TINYSHAKESPEARE)
                .expect("../shared/data/tinyshakespeare.txt is absent"),
        ),
        path => DataChoice::File(PathBuf::from(path)),
    };
    let (data, info) = load_data(&choice).expect("training text");
    let model = Gpt::new(gpt.with_vocab(info.vocab)).expect("model");
    let topology = Topology::ranks(NODES * local).per_node(local).expect("topology");
    let (world, seq, layers) = (topology.world(), model.config().seq_len, model.layers().len());
    let banner =
        format!("{} ({} params), {world} ranks = {NODES} x {local}", info.description, model.num_params());
    let cfg = EngineConfig { zero, ..EngineConfig::default() };
    let plan = build_plan(&model, &cfg, topology).expect("the partition plan");
    Setup { data, model, topology, world, seq, layers, banner, cfg, plan }
}

/// Every layer's shard length (one rank's share of its padded bucket).
pub(crate) fn shard_lens(plan: &PartitionPlan) -> Result<Vec<usize>, EngineError> {
    (0..plan.buckets().len()).map(|l| Ok(plan.shard_len(l)?)).collect()
}

/// Layer `l`'s local gradient padded to its bucket, and its exact mean over
/// the world, this rank's shard of it: f32 on the hierarchical route, as the
/// probes' exact trajectory reduces.
pub(crate) fn exact_mean<C: Communicator + ?Sized>(
    comm: &mut C,
    plan: &PartitionPlan,
    l: usize,
    grad: &[f32],
) -> Result<(Vec<f32>, Vec<f32>), EngineError> {
    let b = plan.bucket(l)?;
    let mut full = vec![0.0f32; b.padded_len];
    b.expand_into(grad, &mut full)?;
    let mut mean = vec![0.0f32; plan.shard_len(l)?];
    world_reduce_scatter(comm, Routing::Hierarchical, DenseWire::F32, &full, &mut mean, Reduce::Mean)?;
    Ok((full, mean))
}

/// The exact step the probes train along: the global norm of the exact mean
/// gradients `exact` (this rank's shard of every layer), clipping at
/// `clipping`, AdamW on every shard, then every rank's full parameters
/// gathered exactly (f32).
#[allow(dead_code)] // loco_probe steps along a variant's trajectory, its own way
pub(crate) fn exact_step<C: Communicator + ?Sized>(
    comm: &mut C,
    plan: &PartitionPlan,
    clipping: Option<f32>,
    opt: &mut [AdamW],
    params: &mut [Vec<f32>],
    exact: &[Vec<f32>],
) -> Result<(), EngineError> {
    let (rank, topo) = (comm.rank(), *comm.topology());
    let sq: f64 = exact.iter().flatten().map(|&x| f64::from(x).powi(2)).sum();
    let mut all = vec![0.0f64; topo.world()];
    zeropp_comm::CommExt::all_gather(comm, &zeropp_comm::Group::world(&topo), &[sq], &mut all)?;
    let factor = clip_factor(all.iter().sum::<f64>().sqrt() as f32, clipping);
    for (l, (p, o)) in params.iter_mut().zip(opt.iter_mut()).enumerate() {
        let (b, s) = (plan.bucket(l)?, plan.shard_len(l)?);
        let mut flat = vec![0.0f32; b.padded_len];
        b.expand_into(p, &mut flat)?;
        let mut shard_p = flat[rank * s..(rank + 1) * s].to_vec();
        o.step(&mut shard_p, &exact[l], factor)?;
        let mut gathered = vec![0.0f32; b.padded_len];
        world_all_gather(comm, Routing::Hierarchical, DenseWire::F32, &shard_p, &mut gathered)?;
        *p = b.compact(&gathered)?;
    }
    Ok(())
}

/// The positions of a bucket's padded flat vector that hold 1-D parameters
/// (biases, norms), which the engine's qgZ sends exactly.
pub(crate) fn one_d_mask(b: &BucketLayout) -> Vec<bool> {
    let mut mask = vec![false; b.padded_len];
    for p in b.params.iter().filter(|p| p.shape.len() == 1) {
        mask[p.range()].iter_mut().for_each(|m| *m = true);
    }
    mask
}

/// The phases reported on, as `(first step, end step)`: steps 0-99, 100-499
/// and 500 on (those that `steps` reaches).
pub(crate) fn phases(steps: usize) -> Vec<(usize, usize)> {
    let mut cuts: Vec<usize> = [0, 100, 500].into_iter().filter(|&c| c < steps).collect();
    cuts.push(steps);
    cuts.windows(2).map(|w| (w[0], w[1])).collect()
}

/// Runs `rank` on every rank of the probes' cluster (threads) with the model's
/// initial parameters (from `seed`) and every layer's shard length, and
/// returns the ranks' results in rank order. Aborts on a rank's failure.
pub(crate) fn on_ranks<T: Send>(
    setup: &Setup,
    seed: u64,
    rank: impl Fn(&mut ThreadComm, Vec<Vec<f32>>, &[usize]) -> Result<T, Box<dyn std::error::Error + Send + Sync>>
    + Sync,
) -> Vec<T> {
    let cluster = ThreadCluster::new(setup.topology, ThreadOptions::default());
    cluster
        .run(|comm| {
            let params = init_params(&setup.model, seed)?;
            let s = shard_lens(&setup.plan)?;
            rank(comm, params, &s)
        })
        .expect("the probe's cluster")
}
