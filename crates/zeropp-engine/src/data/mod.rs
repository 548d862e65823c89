//! Training data: a seeded Markov text source with an exact entropy rate, a
//! character-level dataset with a train/validation split, and global batch
//! sampling that does not depend on the world size.
//!
//! Every sequence of a global batch is drawn with a counter-based RNG keyed
//! by `(seed, step, micro, sequence index)`; [`shard`] hands rank `r` the
//! contiguous slice `r` of the global batch. A run on `W` ranks therefore
//! sees exactly the sequences of a single-rank run with the same global batch.

use std::path::Path;

use crate::EngineError;
use crate::model::Batch;
use crate::model::rng::{SplitMix64, below, hash_keys};

mod choice;
mod info;
pub use choice::{DataChoice, load_data};
pub use info::DataInfo;

/// The default 32-symbol alphabet of [`MarkovSource`]: space, `a`-`z` and five punctuation marks.
pub const DEFAULT_ALPHABET: &str = " abcdefghijklmnopqrstuvwxyz.,;'!";

/// Shape of a [`MarkovSource`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MarkovConfig {
    /// Symbols, taken from the front of [`DEFAULT_ALPHABET`] (1..=32).
    pub alphabet_size: usize,
    /// Order `k`: the next symbol depends on the previous `k` symbols (1..=4).
    pub order: usize,
    /// Successors that carry the peaked part of each transition row (1..=alphabet_size).
    pub support: usize,
    /// Probability mass spread uniformly over all symbols in every row, in
    /// `(0, 1]`. It makes the chain irreducible and aperiodic, so the
    /// stationary distribution is unique and the entropy rate is that of any
    /// long sample.
    pub smoothing: f64,
}

impl Default for MarkovConfig {
    /// 32 symbols, order 2, 4 peaked successors, smoothing 0.02 (about 1.2 nats/char).
    fn default() -> Self {
        Self { alphabet_size: 32, order: 2, support: 4, smoothing: 0.02 }
    }
}

/// A seeded random order-`k` Markov chain over a small alphabet, with sparse,
/// peaked transition rows, used to generate the default training text.
///
/// Each of the `A^k` contexts (states) gets `support` distinct successors
/// with geometrically decaying weights `r^i` (`r` drawn in `[0.25, 0.6]` per
/// row), mixed with `smoothing` uniform mass. The stationary distribution
/// over states is computed by power iteration (`pi <- pi P` from the uniform
/// distribution until the L1 change is below `1e-13`); the entropy rate is
/// then exact: `H = sum_s pi(s) H(P(. | s))`. It is the loss floor of a
/// model that sees at least `k` previous characters.
///
/// ```
/// use zeropp_engine::data::MarkovSource;
///
/// let src = MarkovSource::new(7);
/// let text = src.generate(2000, 1);
/// assert_eq!(text.chars().count(), 2000);
/// assert_eq!(text, src.generate(2000, 1)); // deterministic
/// let h = src.entropy_rate_nats();
/// assert!(h > 0.0 && h < (src.alphabet().len() as f64).ln());
/// assert!((src.entropy_rate_bits() - h / std::f64::consts::LN_2).abs() < 1e-12);
/// ```
#[derive(Debug, Clone)]
pub struct MarkovSource {
    alphabet: Vec<char>,
    order: usize,
    /// `probs[state * A + c]`; a state is the base-A number of the last `order` symbols, oldest first.
    probs: Vec<f64>,
    stationary: Vec<f64>,
    entropy_nats: f64,
}

impl MarkovSource {
    /// The default source ([`MarkovConfig::default`]) for `seed`.
    pub fn new(seed: u64) -> Self {
        // The default config is valid, so this cannot fail; fall back to the
        // smallest chain rather than panic should that ever change.
        Self::with_config(MarkovConfig::default(), seed).unwrap_or_else(|_| {
            Self::build(MarkovConfig { alphabet_size: 2, order: 1, support: 1, smoothing: 0.5 }, seed)
        })
    }

    /// A source of the given shape for `seed`.
    pub fn with_config(cfg: MarkovConfig, seed: u64) -> Result<Self, EngineError> {
        let max_a = DEFAULT_ALPHABET.chars().count();
        if !(1..=max_a).contains(&cfg.alphabet_size) {
            return Err(EngineError::InvalidConfig(format!(
                "markov: alphabet_size {} not in 1..={max_a}",
                cfg.alphabet_size
            )));
        }
        if !(1..=4).contains(&cfg.order) {
            return Err(EngineError::InvalidConfig(format!("markov: order {} not in 1..=4", cfg.order)));
        }
        if !(1..=cfg.alphabet_size).contains(&cfg.support) {
            return Err(EngineError::InvalidConfig(format!(
                "markov: support {} not in 1..={}",
                cfg.support, cfg.alphabet_size
            )));
        }
        if !(cfg.smoothing > 0.0 && cfg.smoothing <= 1.0) {
            return Err(EngineError::InvalidConfig(format!(
                "markov: smoothing {} not in (0, 1]",
                cfg.smoothing
            )));
        }
        Ok(Self::build(cfg, seed))
    }

    fn build(cfg: MarkovConfig, seed: u64) -> Self {
        let a = cfg.alphabet_size;
        let states = a.pow(cfg.order as u32);
        let alphabet: Vec<char> = DEFAULT_ALPHABET.chars().take(a).collect();
        let mut probs = vec![cfg.smoothing / a as f64; states * a];
        let mut rng = SplitMix64::from_keys(&[seed, 0x3A4B, a as u64, cfg.order as u64]);
        let mut perm: Vec<usize> = (0..a).collect();
        for row in probs.chunks_exact_mut(a) {
            // Partial Fisher-Yates: the first `support` entries of perm are the successors.
            for i in 0..cfg.support {
                let j = i + rng.below(a - i);
                perm.swap(i, j);
            }
            let r = 0.25 + 0.35 * rng.next_f64();
            let weights: Vec<f64> = (0..cfg.support).map(|i| r.powi(i as i32)).collect();
            let total: f64 = weights.iter().sum();
            for (&c, w) in perm.iter().zip(&weights) {
                row[c] += (1.0 - cfg.smoothing) * w / total;
            }
        }
        let stationary = stationary_distribution(&probs, a, states);
        let entropy_nats = stationary
            .iter()
            .zip(probs.chunks_exact(a))
            .map(|(&pi, row)| pi * row.iter().map(|&p| if p > 0.0 { -p * p.ln() } else { 0.0 }).sum::<f64>())
            .sum();
        Self { alphabet, order: cfg.order, probs, stationary, entropy_nats }
    }

    /// The symbols the source emits, in id order.
    pub fn alphabet(&self) -> &[char] {
        &self.alphabet
    }

    /// The order `k` of the chain.
    pub fn order(&self) -> usize {
        self.order
    }

    /// Stationary distribution over the `A^k` states (base-A context numbers, oldest symbol first).
    pub fn stationary(&self) -> &[f64] {
        &self.stationary
    }

    /// Transition row of `state`: `P(next = c | state)` for every symbol id `c`
    /// (`None` if the state is out of range).
    pub fn transition(&self, state: usize) -> Option<&[f64]> {
        let a = self.alphabet.len();
        self.probs.get(state * a..(state + 1) * a)
    }

    /// Exact entropy rate in nats per character (the loss floor).
    pub fn entropy_rate_nats(&self) -> f64 {
        self.entropy_nats
    }

    /// Exact entropy rate in bits per character.
    pub fn entropy_rate_bits(&self) -> f64 {
        self.entropy_nats / std::f64::consts::LN_2
    }

    /// Generates `len` symbol ids; the first state is drawn from the stationary distribution.
    pub fn generate_ids(&self, len: usize, seed: u64) -> Vec<usize> {
        let a = self.alphabet.len();
        let states = self.stationary.len();
        let mut rng = SplitMix64::from_keys(&[seed, 0x7E47, a as u64, self.order as u64]);
        let mut state = sample(&self.stationary, rng.next_f64());
        let mut out = Vec::with_capacity(len);
        // The initial context, oldest symbol first.
        for i in (0..self.order).rev() {
            out.push((state / a.pow(i as u32)) % a);
        }
        out.truncate(len);
        while out.len() < len {
            let row = &self.probs[state * a..(state + 1) * a];
            let c = sample(row, rng.next_f64());
            out.push(c);
            state = (state * a) % states + c;
        }
        out
    }

    /// Generates `len` characters of text.
    pub fn generate(&self, len: usize, seed: u64) -> String {
        self.generate_ids(len, seed).into_iter().map(|c| self.alphabet[c]).collect()
    }

    /// Mean `-ln P(x_t | previous k symbols)` of `text` under this chain, over
    /// the positions `t >= k`; `None` when a character is not in the
    /// alphabet or the text has no position past the first context. For a
    /// long generated text it converges to the entropy rate.
    pub fn cross_entropy_nats(&self, text: &str) -> Option<f64> {
        let a = self.alphabet.len();
        let states = self.stationary.len();
        let ids: Option<Vec<usize>> =
            text.chars().map(|ch| self.alphabet.iter().position(|&c| c == ch)).collect();
        let ids = ids?;
        if ids.len() <= self.order {
            return None;
        }
        let mut state = ids[..self.order].iter().fold(0, |s, &c| s * a + c);
        let mut total = 0.0;
        for &c in &ids[self.order..] {
            total -= self.probs[state * a + c].ln();
            state = (state * a) % states + c;
        }
        Some(total / (ids.len() - self.order) as f64)
    }
}

/// Index drawn from a discrete distribution `p` with a uniform `u` in `[0, 1)`.
fn sample(p: &[f64], u: f64) -> usize {
    let mut acc = 0.0;
    for (i, &pi) in p.iter().enumerate() {
        acc += pi;
        if u < acc {
            return i;
        }
    }
    // Rounding left u above the total: take the last symbol with mass.
    p.iter().rposition(|&x| x > 0.0).unwrap_or(0)
}

/// Power iteration `pi <- pi P` on the `A^k` states from the uniform distribution.
fn stationary_distribution(probs: &[f64], a: usize, states: usize) -> Vec<f64> {
    let mut pi = vec![1.0 / states as f64; states];
    let mut next = vec![0.0; states];
    for _ in 0..100_000 {
        next.fill(0.0);
        for (s, (&ps, row)) in pi.iter().zip(probs.chunks_exact(a)).enumerate() {
            let base = (s * a) % states;
            for (c, &p) in row.iter().enumerate() {
                next[base + c] += ps * p;
            }
        }
        let total: f64 = next.iter().sum();
        let mut diff = 0.0;
        for (p, n) in pi.iter_mut().zip(&next) {
            let v = n / total;
            diff += (*p - v).abs();
            *p = v;
        }
        if diff < 1e-13 {
            break;
        }
    }
    pi
}

/// A token dataset with a train/validation split: character-level from text
/// (the distinct characters, sorted, are the vocabulary, ids `0..vocab`), or
/// token ids a user already made ([`TextDataset::from_tokens`]). The last
/// `val_fraction` of the tokens is the validation split.
#[derive(Debug, Clone)]
pub struct TextDataset {
    /// The characters of a character-level dataset (empty for token data).
    vocab: Vec<char>,
    vocab_size: usize,
    train: Vec<u32>,
    val: Vec<u32>,
}

impl TextDataset {
    /// Share of the tokens held out for validation by [`from_text`](Self::from_text).
    pub const DEFAULT_VAL_FRACTION: f64 = 0.1;

    /// A dataset from `text`, with the last 10% as validation split.
    pub fn from_text(text: &str) -> Result<Self, EngineError> {
        Self::from_text_with_split(text, Self::DEFAULT_VAL_FRACTION)
    }

    /// A dataset from `text` with the last `val_fraction` (in `[0, 1)`) of the tokens as validation split.
    pub fn from_text_with_split(text: &str, val_fraction: f64) -> Result<Self, EngineError> {
        if !(0.0..1.0).contains(&val_fraction) {
            return Err(EngineError::InvalidConfig(format!("val_fraction {val_fraction} not in [0, 1)")));
        }
        if text.is_empty() {
            return Err(EngineError::EmptyText);
        }
        let mut vocab: Vec<char> = text.chars().collect();
        vocab.sort_unstable();
        vocab.dedup();
        if u32::try_from(vocab.len()).is_err() {
            return Err(EngineError::InvalidConfig("vocabulary exceeds u32 ids".into()));
        }
        let ids: Vec<u32> = text.chars().map(|c| vocab.binary_search(&c).map_or(0, |i| i as u32)).collect();
        let n_val = ((ids.len() as f64) * val_fraction).round() as usize;
        let split = ids.len() - n_val.min(ids.len());
        let val = ids[split..].to_vec();
        let mut train = ids;
        train.truncate(split);
        Ok(Self { vocab_size: vocab.len(), vocab, train, val })
    }

    /// A dataset of token ids a user already made (any tokenizer): ids must be
    /// below `vocab_size`; the last `val_fraction` (in `[0, 1)`) of `tokens` is
    /// the validation split. Training checks `vocab_size` against the model's:
    /// a model with a smaller vocabulary is a clear error, never an
    /// out-of-range embedding lookup.
    ///
    /// ```
    /// use zeropp_engine::data::TextDataset;
    /// let tokens: Vec<u32> = (0..1000).map(|i| (i * 7 % 50) as u32).collect();
    /// let ds = TextDataset::from_tokens(50, tokens, 0.1)?;
    /// assert_eq!((ds.vocab_size(), ds.train_tokens().len(), ds.val_tokens().len()), (50, 900, 100));
    /// assert!(ds.vocab().is_empty()); // no characters: token data
    /// let err = TextDataset::from_tokens(50, vec![3, 50, 4], 0.0).unwrap_err();
    /// assert!(err.to_string().contains("token 50"), "{err}");
    /// # Ok::<(), zeropp_engine::EngineError>(())
    /// ```
    pub fn from_tokens(vocab_size: usize, tokens: Vec<u32>, val_fraction: f64) -> Result<Self, EngineError> {
        if !(0.0..1.0).contains(&val_fraction) {
            return Err(EngineError::InvalidConfig(format!("val_fraction {val_fraction} not in [0, 1)")));
        }
        if tokens.is_empty() {
            return Err(EngineError::EmptyText);
        }
        if vocab_size == 0 || u32::try_from(vocab_size).is_err() {
            return Err(EngineError::InvalidConfig(format!(
                "vocabulary size {vocab_size} must be in 1..=2^32"
            )));
        }
        if let Some((i, &t)) = tokens.iter().enumerate().find(|&(_, &t)| t as usize >= vocab_size) {
            return Err(EngineError::InvalidConfig(format!(
                "token {t} at position {i} is outside the vocabulary of {vocab_size} ids"
            )));
        }
        let n_val = ((tokens.len() as f64) * val_fraction).round() as usize;
        let split = tokens.len() - n_val.min(tokens.len());
        let val = tokens[split..].to_vec();
        let mut train = tokens;
        train.truncate(split);
        Ok(Self { vocab: Vec::new(), vocab_size, train, val })
    }

    /// A dataset from a file: UTF-8 text, or (if the bytes are not UTF-8)
    /// one character per byte (Latin-1). Last 10% is validation.
    pub fn from_file(path: &Path) -> Result<Self, EngineError> {
        let bytes =
            std::fs::read(path).map_err(|source| EngineError::Io { path: path.to_path_buf(), source })?;
        match String::from_utf8(bytes) {
            Ok(text) => Self::from_text(&text),
            Err(e) => {
                let text: String = e.into_bytes().into_iter().map(char::from).collect();
                Self::from_text(&text)
            }
        }
    }

    /// A dataset of `len` characters generated by `source` with `seed`.
    pub fn generated(source: &MarkovSource, len: usize, seed: u64) -> Result<Self, EngineError> {
        Self::from_text(&source.generate(len, seed))
    }

    /// Vocabulary size: token ids are `0..vocab_size`.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The characters of the vocabulary, sorted; index = token id (empty for
    /// token data, [`TextDataset::from_tokens`]).
    pub fn vocab(&self) -> &[char] {
        &self.vocab
    }

    /// Token ids of `text`; `None` if a character is not in the vocabulary.
    pub fn encode(&self, text: &str) -> Option<Vec<u32>> {
        text.chars().map(|c| self.vocab.binary_search(&c).ok().map(|i| i as u32)).collect()
    }

    /// Text of token ids (ids out of range become `U+FFFD`).
    pub fn decode(&self, ids: &[u32]) -> String {
        ids.iter().map(|&i| self.vocab.get(i as usize).copied().unwrap_or('\u{FFFD}')).collect()
    }

    /// Training-split token ids.
    pub fn train_tokens(&self) -> &[u32] {
        &self.train
    }

    /// Validation-split token ids.
    pub fn val_tokens(&self) -> &[u32] {
        &self.val
    }

    /// Errors unless the training split holds at least `seq_len + 1` tokens.
    pub fn check_seq_len(&self, seq_len: usize) -> Result<(), EngineError> {
        if seq_len == 0 {
            return Err(EngineError::InvalidConfig("seq_len must be > 0".into()));
        }
        if self.train.len() < seq_len + 1 {
            return Err(EngineError::TextTooShort {
                split: "train",
                len: self.train.len(),
                needed: seq_len + 1,
            });
        }
        Ok(())
    }

    /// The global batch of micro-batch `micro` of step `step`: `global_batch`
    /// training windows of `seq_len + 1` tokens, window `i` starting at a
    /// position drawn by a counter-based RNG keyed by `(seed, step, micro, i)`.
    /// Independent of the world size: shard it with [`shard`].
    pub fn global_batch(
        &self,
        step: u64,
        micro: usize,
        global_batch: usize,
        seq_len: usize,
        seed: u64,
    ) -> Result<Batch, EngineError> {
        self.check_seq_len(seq_len)?;
        if global_batch == 0 {
            return Err(EngineError::InvalidConfig("global batch must be > 0".into()));
        }
        let windows = self.train.len() - seq_len;
        let mut inputs = Vec::with_capacity(global_batch * seq_len);
        let mut targets = Vec::with_capacity(global_batch * seq_len);
        for i in 0..global_batch {
            let h = hash_keys(&[seed, 0xDA7A, step, micro as u64, i as u64]);
            let start = below(h, windows);
            inputs.extend_from_slice(&self.train[start..start + seq_len]);
            targets.extend_from_slice(&self.train[start + 1..start + seq_len + 1]);
        }
        Ok(Batch { inputs, targets, batch: global_batch, seq_len })
    }

    /// The deterministic validation set: consecutive non-overlapping windows
    /// (stride `seq_len`) of the validation split from its start, grouped into
    /// at most `max_batches` full batches of `batch` sequences. Errors if not
    /// even one full batch fits.
    pub fn val_batches(
        &self,
        batch: usize,
        seq_len: usize,
        max_batches: usize,
    ) -> Result<Vec<Batch>, EngineError> {
        if batch == 0 || seq_len == 0 {
            return Err(EngineError::InvalidConfig("validation batch and seq_len must be > 0".into()));
        }
        let windows = self.val.len().saturating_sub(1) / seq_len;
        let full = windows / batch;
        if full == 0 {
            return Err(EngineError::TextTooShort {
                split: "validation",
                len: self.val.len(),
                needed: batch * seq_len + 1,
            });
        }
        Ok((0..full.min(max_batches))
            .map(|bi| {
                let mut inputs = Vec::with_capacity(batch * seq_len);
                let mut targets = Vec::with_capacity(batch * seq_len);
                for w in bi * batch..(bi + 1) * batch {
                    let s = w * seq_len;
                    inputs.extend_from_slice(&self.val[s..s + seq_len]);
                    targets.extend_from_slice(&self.val[s + 1..s + seq_len + 1]);
                }
                Batch { inputs, targets, batch, seq_len }
            })
            .collect())
    }
}

/// Rank `rank`'s contiguous slice of a global batch: sequences
/// `rank * b / world .. (rank + 1) * b / world`. Errors unless `world > 0`,
/// `rank < world` and `world` divides the batch.
pub fn shard(batch: &Batch, rank: usize, world: usize) -> Result<Batch, EngineError> {
    let err = EngineError::InvalidShard { batch: batch.batch, rank, world };
    if world == 0 || rank >= world || !batch.batch.is_multiple_of(world) {
        return Err(err);
    }
    batch.check_lengths()?;
    let per = batch.batch / world;
    let range = rank * per * batch.seq_len..(rank + 1) * per * batch.seq_len;
    Ok(Batch {
        inputs: batch.inputs[range.clone()].to_vec(),
        targets: batch.targets[range].to_vec(),
        batch: per,
        seq_len: batch.seq_len,
    })
}
