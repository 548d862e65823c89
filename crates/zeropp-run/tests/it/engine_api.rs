//! The public training API for a model of your own: `launch` gives what
//! `train` gives the built-in models, checks the data against the model, and
//! refuses layer lists that would clash inside the engine.

use zeropp_engine::EngineError;
use zeropp_engine::data::TextDataset;
use zeropp_engine::data::{DataChoice, load_data};
use zeropp_engine::launch;
use zeropp_engine::model::{Batch, Gpt, GptConfig, GptTape, LayerSpec, Model};
use zeropp_run::train::{ModelChoice, TrainConfig, train};

/// The built-in GPT behind a renamed layer list (delegates everything else),
/// noting at each forward which thread ran it and how many threads its
/// parallel loops may use.
struct Renamed {
    inner: Gpt,
    layers: Vec<LayerSpec>,
    seen: std::sync::Mutex<std::collections::BTreeSet<(String, usize)>>,
}

impl Renamed {
    fn new(vocab: usize, rename: impl Fn(usize, &LayerSpec) -> String) -> Self {
        let inner = Gpt::new(GptConfig::tiny().with_vocab(vocab)).unwrap();
        let layers = inner
            .layers()
            .iter()
            .enumerate()
            .map(|(i, l)| LayerSpec { name: rename(i, l), params: l.params.clone() })
            .collect();
        Self { inner, layers, seen: Default::default() }
    }
}

impl Model for Renamed {
    type Tape = GptTape;
    fn name(&self) -> &str {
        "renamed-gpt"
    }
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
    fn seq_len(&self) -> usize {
        self.inner.seq_len()
    }
    fn layers(&self) -> &[LayerSpec] {
        &self.layers
    }
    fn init_layer(&self, layer: usize, seed: u64, out: &mut [f32]) -> Result<(), EngineError> {
        self.inner.init_layer(layer, seed, out)
    }
    fn start(&self, batch: &Batch) -> Result<GptTape, EngineError> {
        self.inner.start(batch)
    }
    fn forward(&self, layer: usize, params: &[f32], tape: &mut GptTape) -> Result<(), EngineError> {
        let name = std::thread::current().name().unwrap_or("unnamed").to_string();
        self.seen.lock().unwrap().insert((name, rayon::current_num_threads()));
        self.inner.forward(layer, params, tape)
    }
    fn loss(&self, tape: &GptTape) -> f32 {
        self.inner.loss(tape)
    }
    fn backward(
        &self,
        layer: usize,
        p: &[f32],
        tape: &mut GptTape,
        g: &mut [f32],
    ) -> Result<(), EngineError> {
        self.inner.backward(layer, p, tape, g)
    }
}

#[test]
fn launch_is_what_train_runs() {
    // `train` with a ModelChoice is one user of `launch`: the same model and
    // data through the public door give the same losses, bit for bit.
    let cfg = TrainConfig::tiny().with_steps(4);
    let via_choice = train(&cfg).unwrap();
    let (data, _) = load_data(&cfg.data).unwrap();
    let ModelChoice::Gpt(g) = cfg.model.clone() else { panic!("tiny is a GPT") };
    let model = Gpt::new(g.with_vocab(data.vocab_size())).unwrap();
    let via_model = launch(&model, &data, &cfg.run).unwrap();
    let bits = |r: &zeropp_engine::TrainReport| r.steps.iter().map(|s| s.loss.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&via_choice), bits(&via_model));
    assert_eq!(via_choice.summary.bytes_per_step, via_model.summary.bytes_per_step);
}

#[test]
fn token_data_trains_and_its_vocabulary_is_checked() {
    let tokens: Vec<u32> = (0..6000u32).map(|i| (i * 13 + i / 7) % 40).collect();
    let data = TextDataset::from_tokens(40, tokens, 0.1).unwrap();
    let cfg = TrainConfig::tiny().with_steps(3);
    // A model with at least the data's vocabulary trains.
    let big = Gpt::new(GptConfig::tiny().with_vocab(48)).unwrap();
    assert_eq!(launch(&big, &data, &cfg.run).unwrap().steps.len(), 3);
    // A smaller one is a clear error naming both sizes, before any rank starts.
    let small = Gpt::new(GptConfig::tiny().with_vocab(39)).unwrap();
    let err = launch(&small, &data, &cfg.run).unwrap_err().to_string();
    assert!(err.contains("40 ids") && err.contains("39 ids"), "{err}");
    // Bad token data is refused when the dataset is made.
    assert!(TextDataset::from_tokens(40, vec![1, 2, 40], 0.0).is_err());
    assert!(TextDataset::from_tokens(40, Vec::new(), 0.0).is_err());
    assert!(TextDataset::from_tokens(0, vec![0], 0.0).is_err());
    assert!(TextDataset::from_tokens(40, vec![1], 1.0).is_err());
}

#[test]
fn clashing_layer_names_are_clear_errors() {
    let cfg = TrainConfig {
        data: DataChoice::Markov { seed: 1, chars: 20_000 },
        ..TrainConfig::tiny().with_steps(1)
    };
    let (data, _) = load_data(&cfg.data).unwrap();
    let v = data.vocab_size();
    for (model, says) in [
        (Renamed::new(v, |i, l| if i == 0 { "persistent".into() } else { l.name.clone() }), "reserved"),
        (Renamed::new(v, |_, _| "same".into()), "two layers are named `same`"),
        (Renamed::new(v, |i, l| if i == 1 { String::new() } else { l.name.clone() }), "empty name"),
    ] {
        let err = launch(&model, &data, &cfg.run).unwrap_err().to_string();
        assert!(err.contains(says), "{err}");
        assert!(err.contains("renamed-gpt"), "the error names the model: {err}");
    }
    // Renaming alone is fine.
    let ok = Renamed::new(v, |i, _| format!("unit{i}"));
    assert!(launch(&ok, &data, &cfg.run).is_ok());
}

/// On the thread backend each rank computes on its own pool of `cores / ranks`
/// threads (at least one), not on one pool all ranks queue on: its parallel
/// loops run on its own threads, with no hand-off to a shared pool.
#[test]
fn each_rank_computes_on_its_own_share_of_the_cores() {
    if std::env::var_os("RAYON_NUM_THREADS").is_some() {
        eprintln!("skipped: RAYON_NUM_THREADS is set, so the ranks share rayon's global pool by choice");
        return;
    }
    let cfg = TrainConfig::tiny().with_steps(2);
    let (data, _) = load_data(&cfg.data).unwrap();
    // The names as they are: this model only watches.
    let model = Renamed::new(data.vocab_size(), |_, l| l.name.clone());
    launch(&model, &data, &cfg.run).unwrap();
    let world = cfg.run.world;
    assert!(world > 1, "the check needs ranks that share the host");
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let share = (cores / world).max(1);
    let seen = model.seen.into_inner().unwrap();
    let ranks: std::collections::BTreeSet<&str> = seen
        .iter()
        .map(|(name, threads)| {
            assert_eq!(
                *threads, share,
                "{name}: {threads} threads for its loops, not its share {share} of {cores} cores"
            );
            // `zeropp-rank-R-compute-I`; the rank's own thread is `zeropp-rank-R`.
            let rank =
                name.strip_prefix("zeropp-rank-").and_then(|r| r.split_once("-compute-")).map(|(r, _)| r);
            rank.unwrap_or_else(|| panic!("a forward ran on `{name}`, not on a rank's compute pool"))
        })
        .collect();
    assert_eq!(ranks.len(), world, "every rank computes on its own pool: {seen:?}");
}
