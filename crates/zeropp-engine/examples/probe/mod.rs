//! The setup the gradient probes share (`loco_probe`, `qgz_error`): the
//! training text by name, the default small GPT on its vocabulary, the 2 × 4
//! cluster of thread ranks, and the phases of training they report on.
//! (Cargo builds an example from each file of `examples/`, not from its
//! folders, so this one is a module of both.)

use std::path::PathBuf;

use zeropp_comm::Topology;
use zeropp_engine::data::{DataChoice, load_data};
use zeropp_engine::data::{DataInfo, TextDataset};
use zeropp_engine::{Gpt, GptConfig};

/// Nodes of the probes' cluster.
pub(crate) const NODES: usize = 2;
/// Ranks per node.
pub(crate) const LOCAL: usize = 4;
/// Sequences per global batch.
pub(crate) const BATCH: usize = 16;

/// What a probe trains on: the text, what it is, and the default small GPT
/// with the text's vocabulary.
pub(crate) struct Setup {
    /// The training text.
    pub(crate) data: TextDataset,
    /// What it is (description, vocabulary).
    pub(crate) info: DataInfo,
    /// The default small GPT with the text's vocabulary.
    pub(crate) model: Gpt,
    /// [`NODES`] × [`LOCAL`] ranks.
    pub(crate) topology: Topology,
}

/// `--data`'s text (`generated`: the Markov corpus of `zeropp train`;
/// `shakespeare`: `../shared/data/tinyshakespeare.txt`; else a file) and the
/// model and cluster on it. Aborts with the reason when the text is missing.
pub(crate) fn setup(data: &str) -> Setup {
    let choice = match data {
        "generated" => DataChoice::Markov { seed: 0, chars: 200_000 },
        "shakespeare" => DataChoice::File(
            zeropp_tests::data::find(zeropp_tests::data::TINYSHAKESPEARE)
                .expect("../shared/data/tinyshakespeare.txt is absent"),
        ),
        path => DataChoice::File(PathBuf::from(path)),
    };
    let (data, info) = load_data(&choice).expect("training text");
    let model = Gpt::new(GptConfig::default_small().with_vocab(info.vocab)).expect("model");
    let topology = Topology::ranks(NODES * LOCAL).per_node(LOCAL).expect("topology");
    Setup { data, info, model, topology }
}

/// The phases reported on, as `(first step, end step)`: steps 0-99, 100-499
/// and 500 on (those that `steps` reaches).
pub(crate) fn phases(steps: usize) -> Vec<(usize, usize)> {
    let mut cuts: Vec<usize> = [0, 100, 500].into_iter().filter(|&c| c < steps).collect();
    cuts.push(steps);
    cuts.windows(2).map(|w| (w[0], w[1])).collect()
}
