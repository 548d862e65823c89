//! [`GptConfig`]: the shape of a [`Gpt`](super::Gpt), its presets and its checks.

use crate::model::stack::check_sizes;
use crate::{EngineError, Result};

/// Shape of a [`Gpt`](super::Gpt).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GptConfig {
    /// Vocabulary size.
    pub vocab: usize,
    /// Maximum sequence length (rows of the position embedding).
    pub seq_len: usize,
    /// Model width.
    pub d_model: usize,
    /// Attention heads (must divide `d_model`).
    pub n_head: usize,
    /// Transformer blocks.
    pub n_layer: usize,
    /// MLP hidden width as a multiple of `d_model` (4 in GPT-2).
    pub mlp_ratio: usize,
}

impl GptConfig {
    /// A very small model for tests: vocab 11, seq 8, width 16, 2 heads, 2 blocks.
    pub fn tiny() -> Self {
        Self { vocab: 11, seq_len: 8, d_model: 16, n_head: 2, n_layer: 2, mlp_ratio: 4 }
    }

    /// The default training model: vocab 64 (override with [`with_vocab`](Self::with_vocab)),
    /// seq 64, width 64, 4 heads, 2 blocks, MLP ratio 4 (about 0.1 M parameters).
    pub fn default_small() -> Self {
        Self { vocab: 64, seq_len: 64, d_model: 64, n_head: 4, n_layer: 2, mlp_ratio: 4 }
    }

    /// The same config with another vocabulary size.
    pub fn with_vocab(self, vocab: usize) -> Self {
        Self { vocab, ..self }
    }

    /// A GPT of width `d_model`, `n_layer` blocks of `n_head` heads, context
    /// `seq_len`, MLP ratio 4 and a byte-level vocabulary of 256 (training sets
    /// the vocabulary from the data).
    pub fn shape(d_model: usize, n_layer: usize, n_head: usize, seq_len: usize) -> Self {
        Self { vocab: 256, seq_len, d_model, n_head, n_layer, mlp_ratio: 4 }
    }

    /// The named model sizes, smallest first: `gpt-tiny`, `gpt` (the default),
    /// then `gpt-1m`, `gpt-medium`, `gpt-10m`, `gpt-40m` and `gpt2-small` (GPT-2 small's shape:
    /// width 768, 12 blocks, 12 heads, context 1024).
    ///
    /// Vocabularies are byte-level (256 here; training uses the data's). GPT-2
    /// small's "124M" counts its 50257-token embedding (38.6M) once, tied with the
    /// LM head; this GPT has an untied head and a byte vocabulary, so the same
    /// shape is about 86M parameters here, 85M of them in the 12 blocks.
    ///
    /// ```
    /// use zeropp_engine::model::GptConfig;
    /// let (name, g) = GptConfig::presets().last().copied().ok_or("no presets")?;
    /// assert_eq!((name, g.d_model, g.n_layer, g.n_head, g.seq_len), ("gpt2-small", 768, 12, 12, 1024));
    /// assert!((85_000_000..87_000_000).contains(&g.num_params()));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn presets() -> [(&'static str, Self); 7] {
        [
            ("gpt-tiny", Self::tiny()),
            ("gpt", Self::default_small()),
            ("gpt-1m", Self::shape(128, 5, 4, 128)),
            // Communication-bound over a slow link (`cargo xtask bench cluster`).
            ("gpt-medium", Self { seq_len: 32, d_model: 256, n_layer: 3, ..Self::default_small() }),
            ("gpt-10m", Self::shape(384, 6, 6, 256)),
            ("gpt-40m", Self::shape(640, 8, 10, 256)),
            ("gpt2-small", Self::shape(768, 12, 12, 1024)),
        ]
    }

    /// The preset called `name` (see [`presets`](Self::presets)), case-insensitive.
    pub fn preset(name: &str) -> Option<Self> {
        Self::presets().into_iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, g)| g)
    }

    /// Parameters of a [`Gpt`](super::Gpt) of this shape, without building it.
    pub fn num_params(&self) -> usize {
        let (v, t, d) = (self.vocab, self.seq_len, self.d_model);
        let f = self.mlp_ratio * d;
        let block = 4 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d);
        v * d + t * d + self.n_layer * block + 2 * d + d * v + v
    }

    /// The longest context [`validate`](Self::validate) accepts (GPT-2's): the
    /// attention keeps `batch · heads · seq²` probabilities per block.
    pub const MAX_SEQ_LEN: usize = 1024;

    /// Checks that every size is positive, `n_head` divides `d_model` and
    /// `seq_len <= MAX_SEQ_LEN`; errors name the field.
    pub fn validate(&self) -> Result<(), EngineError> {
        let sizes = [
            ("seq_len", self.seq_len),
            ("d_model", self.d_model),
            ("n_head", self.n_head),
            ("mlp_ratio", self.mlp_ratio),
        ];
        check_sizes("gpt", self.vocab, &sizes)?;
        if self.seq_len > Self::MAX_SEQ_LEN {
            return Err(EngineError::InvalidConfig(format!(
                "gpt: seq_len {} exceeds the maximum context {}",
                self.seq_len,
                Self::MAX_SEQ_LEN
            )));
        }
        if !self.d_model.is_multiple_of(self.n_head) {
            return Err(EngineError::InvalidConfig(format!(
                "gpt: n_head {} does not divide d_model {}",
                self.n_head, self.d_model
            )));
        }
        Ok(())
    }
}

impl Default for GptConfig {
    fn default() -> Self {
        Self::default_small()
    }
}
