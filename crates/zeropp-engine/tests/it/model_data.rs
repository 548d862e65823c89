//! Data tests: Markov source entropy and determinism, the text dataset,
//! world-size-independent global batches and sharding.

use proptest::prelude::*;
use zeropp_engine::EngineError;
use zeropp_engine::data::{MarkovConfig, MarkovSource, TextDataset, shard};

#[test]
fn markov_source_is_deterministic_per_seed() {
    let a = MarkovSource::new(3);
    let b = MarkovSource::new(3);
    assert_eq!(a.generate(5000, 9), b.generate(5000, 9));
    assert_eq!(a.entropy_rate_nats().to_bits(), b.entropy_rate_nats().to_bits());
    assert_ne!(a.generate(5000, 9), a.generate(5000, 10));
    assert_ne!(a.generate(5000, 9), MarkovSource::new(4).generate(5000, 9));
    // Prefixes agree: the stream does not depend on the requested length.
    assert!(a.generate(5000, 9).starts_with(&a.generate(100, 9)));
}

#[test]
fn stationary_distribution_is_a_fixed_point() {
    let src = MarkovSource::new(5);
    let pi = src.stationary();
    let a = src.alphabet().len();
    let states = pi.len();
    assert_eq!(states, a.pow(src.order() as u32));
    assert!((pi.iter().sum::<f64>() - 1.0).abs() < 1e-12);
    let mut next = vec![0.0; states];
    for (s, &p) in pi.iter().enumerate() {
        let row = src.transition(s).unwrap();
        assert!((row.iter().sum::<f64>() - 1.0).abs() < 1e-12);
        for (c, &q) in row.iter().enumerate() {
            next[(s * a) % states + c] += p * q;
        }
    }
    let l1: f64 = pi.iter().zip(&next).map(|(x, y)| (x - y).abs()).sum();
    assert!(l1 < 1e-10, "pi P != pi (L1 {l1})");
}

/// The mean log-loss of a long sample under the true chain converges to the
/// entropy rate (ergodic theorem). The tolerance is 6 standard errors of the
/// mean computed from the per-character losses, inflated 3x for the
/// correlation between neighbouring characters.
#[test]
fn entropy_rate_matches_a_long_sample() {
    let src = MarkovSource::new(11);
    let n = 400_000;
    let text = src.generate(n, 1);
    let h = src.entropy_rate_nats();
    let empirical = src.cross_entropy_nats(&text).unwrap();
    // Spread of the per-character loss, from the row entropies' second moment.
    let a = src.alphabet().len();
    let second: f64 = src
        .stationary()
        .iter()
        .enumerate()
        .map(|(s, &p)| p * src.transition(s).unwrap().iter().map(|&q| q * q.ln() * q.ln()).sum::<f64>())
        .sum();
    let sigma = (second - h * h).max(0.0).sqrt();
    let tol = 6.0 * 3.0 * sigma / (n as f64).sqrt();
    assert!(
        (empirical - h).abs() < tol,
        "empirical {empirical} vs entropy rate {h} (tol {tol}, alphabet {a})"
    );
    eprintln!("entropy rate {h:.4} nats/char, sample {empirical:.4}, tol {tol:.4}");
    // The floor is far below a uniform guess and consistent in bits.
    assert!(h < 0.6 * (a as f64).ln(), "entropy rate {h} not peaked");
    assert!((src.entropy_rate_bits() * std::f64::consts::LN_2 - h).abs() < 1e-12);
}

#[test]
fn state_frequencies_match_the_stationary_distribution() {
    let src = MarkovSource::with_config(
        MarkovConfig { alphabet_size: 8, order: 2, support: 3, smoothing: 0.05 },
        2,
    )
    .unwrap();
    let n = 200_000;
    let ids = src.generate_ids(n, 3);
    let a = 8;
    let mut counts = vec![0.0; a * a];
    for w in ids.windows(2) {
        counts[w[0] * a + w[1]] += 1.0;
    }
    let total = (n - 1) as f64;
    let l1: f64 = counts.iter().zip(src.stationary()).map(|(c, p)| (c / total - p).abs()).sum();
    assert!(l1 < 0.03, "L1 distance {l1}");
}

#[test]
fn markov_config_errors() {
    let base = MarkovConfig::default();
    for bad in [
        MarkovConfig { alphabet_size: 0, ..base },
        MarkovConfig { alphabet_size: 33, ..base },
        MarkovConfig { order: 0, ..base },
        MarkovConfig { order: 5, ..base },
        MarkovConfig { support: 0, ..base },
        MarkovConfig { support: 33, ..base },
        MarkovConfig { smoothing: 0.0, ..base },
        MarkovConfig { smoothing: f64::NAN, ..base },
    ] {
        assert!(matches!(MarkovSource::with_config(bad, 1), Err(EngineError::InvalidConfig(_))));
    }
}

#[test]
fn text_dataset_vocab_and_split() {
    let ds = TextDataset::from_text("hello world, hello data!").unwrap();
    let vocab: String = ds.vocab().iter().collect();
    assert_eq!(vocab, " !,adehlortw");
    assert_eq!(ds.vocab_size(), 12);
    let n = 24;
    assert_eq!(ds.train_tokens().len() + ds.val_tokens().len(), n);
    assert_eq!(ds.val_tokens().len(), 2); // round(24 * 0.1)
    let all: Vec<u32> = ds.train_tokens().iter().chain(ds.val_tokens()).copied().collect();
    assert_eq!(ds.decode(&all), "hello world, hello data!");
    assert_eq!(ds.encode("hold").unwrap(), vec![6, 8, 7, 4]);
    assert!(ds.encode("xyz").is_none());
}

#[test]
fn text_dataset_errors() {
    assert!(matches!(TextDataset::from_text(""), Err(EngineError::EmptyText)));
    assert!(TextDataset::from_text_with_split("abc", 1.0).is_err());
    let ds = TextDataset::from_text("abcdefghij").unwrap(); // 9 train, 1 val
    assert!(ds.check_seq_len(8).is_ok());
    assert!(matches!(
        ds.check_seq_len(9),
        Err(EngineError::TextTooShort { split: "train", len: 9, needed: 10 })
    ));
    assert!(ds.global_batch(0, 0, 2, 9, 1).is_err());
    assert!(ds.global_batch(0, 0, 0, 4, 1).is_err());
    assert!(matches!(ds.val_batches(1, 4, 10), Err(EngineError::TextTooShort { .. })));
    let missing = std::env::temp_dir().join("zeropp-no-such-file-7f3a.txt");
    assert!(matches!(TextDataset::from_file(&missing), Err(EngineError::Io { .. })));
    let empty = std::env::temp_dir().join(format!("zeropp-empty-{}.txt", std::process::id()));
    std::fs::write(&empty, b"").unwrap();
    assert!(matches!(TextDataset::from_file(&empty), Err(EngineError::EmptyText)));
    std::fs::remove_file(&empty).unwrap();
}

#[test]
fn from_file_reads_utf8_and_falls_back_to_bytes() {
    let path = std::env::temp_dir().join(format!("zeropp-text-{}.txt", std::process::id()));
    std::fs::write(&path, "héllo wörld héllo wörld").unwrap();
    let ds = TextDataset::from_file(&path).unwrap();
    assert!(ds.vocab().contains(&'é'));
    std::fs::write(&path, [0xFFu8, b'a', b'b', 0xFE, b'a', b'b', b'a', b'b', b'a', b'b']).unwrap();
    let ds = TextDataset::from_file(&path).unwrap();
    assert_eq!(ds.vocab_size(), 4);
    std::fs::remove_file(&path).unwrap();
}

fn dataset() -> TextDataset {
    TextDataset::generated(&MarkovSource::new(1), 20_000, 2).unwrap()
}

#[test]
fn global_batches_are_deterministic_and_consistent() {
    let ds = dataset();
    let b = ds.global_batch(5, 1, 8, 32, 7).unwrap();
    assert_eq!(b, ds.global_batch(5, 1, 8, 32, 7).unwrap());
    assert_ne!(b, ds.global_batch(6, 1, 8, 32, 7).unwrap());
    assert_ne!(b, ds.global_batch(5, 0, 8, 32, 7).unwrap());
    assert_ne!(b, ds.global_batch(5, 1, 8, 32, 8).unwrap());
    assert_eq!((b.batch, b.seq_len, b.inputs.len(), b.targets.len()), (8, 32, 256, 256));
    // Targets are the inputs shifted by one, inside the training split.
    let train = ds.train_tokens();
    for s in 0..b.batch {
        let inp = &b.inputs[s * 32..(s + 1) * 32];
        let tgt = &b.targets[s * 32..(s + 1) * 32];
        assert_eq!(inp[1..], tgt[..31]);
        assert!(train.windows(33).any(|w| w[..32] == *inp && w[32] == tgt[31]));
    }
    // A larger global batch extends the smaller one (sequence i is keyed by i).
    let big = ds.global_batch(5, 1, 16, 32, 7).unwrap();
    assert_eq!(big.inputs[..256], b.inputs[..]);
}

#[test]
fn val_batches_are_fixed_consecutive_windows() {
    let ds = dataset();
    let vb = ds.val_batches(4, 32, 3).unwrap();
    assert_eq!(vb.len(), 3);
    assert_eq!(vb, ds.val_batches(4, 32, 3).unwrap());
    let val = ds.val_tokens();
    assert_eq!(vb[0].inputs[..32], val[..32]);
    assert_eq!(vb[0].targets[..32], val[1..33]);
    assert_eq!(vb[1].inputs[..32], val[4 * 32..5 * 32]);
    // max_batches caps; everything available otherwise.
    let all = ds.val_batches(4, 32, usize::MAX).unwrap();
    assert_eq!(all.len(), (val.len() - 1) / 32 / 4);
}

#[test]
fn shard_errors() {
    let b = dataset().global_batch(0, 0, 6, 8, 1).unwrap();
    assert!(matches!(shard(&b, 0, 4), Err(EngineError::InvalidShard { .. })));
    assert!(matches!(shard(&b, 3, 3), Err(EngineError::InvalidShard { .. })));
    assert!(matches!(shard(&b, 0, 0), Err(EngineError::InvalidShard { .. })));
    assert_eq!(shard(&b, 0, 1).unwrap(), b);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Concatenating every rank's shard gives back the global batch, for any
    /// world size dividing it: W ranks see what one rank sees.
    #[test]
    fn shards_concatenate_to_the_global_batch(
        per_rank in 1usize..5,
        world in 1usize..9,
        seq_len in 1usize..40,
        step in 0u64..1000,
        micro in 0usize..4,
        seed in any::<u64>(),
    ) {
        let ds = dataset();
        let global = ds.global_batch(step, micro, per_rank * world, seq_len, seed).unwrap();
        let mut inputs = Vec::new();
        let mut targets = Vec::new();
        for rank in 0..world {
            let s = shard(&global, rank, world).unwrap();
            prop_assert_eq!(s.batch, per_rank);
            prop_assert_eq!(s.seq_len, seq_len);
            inputs.extend(s.inputs);
            targets.extend(s.targets);
        }
        prop_assert_eq!(inputs, global.inputs);
        prop_assert_eq!(targets, global.targets);
    }
}
