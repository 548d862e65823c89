//! The candle Llama's shape as a run names it,
//! `llama[:d=,layers=,heads=,kv_heads=,seq=,ff=,tie=]` (`zeropp train
//! --model`): parsed and checked here; the model and its training are
//! zeropp-candle's and the engine's.

use zeropp_candle::{CandleModel, LlamaConfig};

use crate::RunError;

/// A Llama shape, before the data fixes the vocabulary.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LlamaShape {
    d: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    seq: usize,
    ff: Option<usize>,
    /// `tie=1`: the LM head is the input embedding (`tie_word_embeddings`).
    tie: bool,
}

impl LlamaShape {
    /// The model over `vocab` token ids.
    pub fn build(&self, vocab: usize) -> Result<CandleModel, RunError> {
        Ok(self.config(vocab).build()?)
    }

    /// The decoder's configuration over `vocab` token ids (its SwiGLU width
    /// `ff=` where given, else [`LlamaConfig::shape`]'s `8d/3`).
    ///
    /// ```
    /// use zeropp_run::llama::LlamaShape;
    /// let s = LlamaShape::parse("llama:d=768,layers=8,heads=12,kv_heads=4")?.ok_or("a llama")?;
    /// assert_eq!(s.config(32000).d_ff, 2048);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn config(&self, vocab: usize) -> LlamaConfig {
        let mut c = LlamaConfig::shape(vocab, self.d, self.layers, self.heads, self.kv_heads, self.seq);
        if let Some(ff) = self.ff {
            c.d_ff = ff;
        }
        c.tie_word_embeddings = self.tie;
        c
    }

    /// `Some(shape)` when `spec` names the Llama (`llama` or
    /// `llama:KEY=VALUE,...`, with Hugging Face's key names accepted too),
    /// `None` for any other name; a bad key or size is
    /// [`RunError::InvalidConfig`] saying which.
    ///
    /// ```
    /// use zeropp_run::llama::LlamaShape;
    /// assert!(LlamaShape::parse("gpt")?.is_none());
    /// assert!(LlamaShape::parse("llama:d=128,layers=3,heads=8,kv_heads=4")?.is_some());
    /// assert!(LlamaShape::parse("llama:d=63").is_err()); // not a multiple of the heads
    /// # Ok::<(), zeropp_run::RunError>(())
    /// ```
    pub fn parse(spec: &str) -> Result<Option<Self>, RunError> {
        parse(spec)
    }

    /// Parameters at a byte vocabulary of 256 (for the help).
    fn params(&self) -> usize {
        let c = LlamaConfig::shape(256, self.d, self.layers, self.heads, self.kv_heads, self.seq);
        LlamaConfig { tie_word_embeddings: self.tie, ..c }.num_params()
    }
}

/// The default shape: about the native default GPT's size.
const DEFAULT: LlamaShape =
    LlamaShape { d: 64, layers: 2, heads: 4, kv_heads: 2, seq: 64, ff: None, tie: false };

/// The parser behind [`LlamaShape::parse`].
fn parse(spec: &str) -> Result<Option<LlamaShape>, RunError> {
    let bad = |msg: String| RunError::InvalidConfig(format!("model `{spec}`: {msg}"));
    let (name, keys) = match spec.split_once(':') {
        Some((n, k)) => (n.trim(), k),
        None => (spec.trim(), ""),
    };
    if !name.eq_ignore_ascii_case("llama") {
        return Ok(None);
    }
    let mut s = DEFAULT;
    for kv in keys.split(',').map(str::trim).filter(|kv| !kv.is_empty()) {
        let Some((k, v)) = kv.split_once('=') else {
            return Err(bad(format!("`{kv}` is not key=value")));
        };
        let (k, v) = (k.trim(), v.trim());
        if matches!(k.to_ascii_lowercase().as_str(), "tie" | "tie_word_embeddings") {
            s.tie = match v {
                "1" | "true" => true,
                "0" | "false" => false,
                _ => return Err(bad(format!("`{k}={v}` must be 0 or 1"))),
            };
            continue;
        }
        let value = v
            .parse::<usize>()
            .ok()
            .filter(|&x| x > 0)
            .ok_or_else(|| bad(format!("`{k}={v}` is not a positive integer")))?;
        match k.to_ascii_lowercase().as_str() {
            "d" | "hidden_size" => s.d = value,
            "layers" | "num_hidden_layers" => s.layers = value,
            "heads" | "num_attention_heads" => s.heads = value,
            "kv_heads" | "num_key_value_heads" => s.kv_heads = value,
            "seq" | "seq_len" => s.seq = value,
            "ff" | "intermediate_size" => s.ff = Some(value),
            _ => {
                return Err(bad(format!(
                    "unknown key `{k}` (expected d, layers, heads, kv_heads, seq, ff or tie)"
                )));
            }
        }
    }
    // The sizes are checked now, with a placeholder vocabulary.
    LlamaConfig::shape(256, s.d, s.layers, s.heads, s.kv_heads, s.seq)
        .validate()
        .map_err(|e| bad(e.to_string()))?;
    Ok(Some(s))
}

/// The Llama's line of `zeropp train --model help`: the default shape, its
/// size and the keys.
pub fn help() -> String {
    format!(
        "  llama       d {:>3}, {:>2} layers, {:>2} heads, seq {:>4}: {:>6.2}M  (zeropp-candle's Llama decoder: RMSNorm, RoPE,\n\
         \x20             SwiGLU, {} key/value heads; `llama:d=,layers=,heads=,kv_heads=,seq=,ff=,tie=`; Hugging Face names)\n",
        DEFAULT.d,
        DEFAULT.layers,
        DEFAULT.heads,
        DEFAULT.seq,
        DEFAULT.params() as f64 / 1e6,
        DEFAULT.kv_heads
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama_specs_parse_and_bad_ones_say_why() -> Result<(), RunError> {
        assert_eq!(parse("gpt")?, None);
        assert_eq!(parse("llama")?, Some(DEFAULT));
        let s = parse("llama:d=128,layers=3,heads=8,kv_heads=4,seq=32,ff=256")?
            .ok_or_else(|| RunError::InvalidConfig("llama".into()))?;
        assert_eq!((s.d, s.layers, s.heads, s.kv_heads, s.seq, s.ff), (128, 3, 8, 4, 32, Some(256)));
        assert!(!s.tie && parse("llama:tie=1")?.ok_or_else(|| RunError::InvalidConfig("llama".into()))?.tie);
        // A tied head is not stored: the parameter count drops by vocab x d.
        assert_eq!(
            DEFAULT.params()
                - parse("llama:tie=1")?.ok_or_else(|| RunError::InvalidConfig("llama".into()))?.params(),
            256 * DEFAULT.d
        );
        for (spec, why) in [
            ("llama:d=63", "multiple of heads"),
            ("llama:heads=4,kv_heads=3", "kv_heads"),
            ("llama:depth=3", "unknown key `depth`"),
            ("llama:d=x", "not a positive integer"),
            ("llama:d", "not key=value"),
            ("llama:tie=2", "must be 0 or 1"),
        ] {
            match parse(spec) {
                Err(RunError::InvalidConfig(msg)) => {
                    assert!(msg.contains(why) && msg.contains(spec), "{spec}: {msg}")
                }
                other => panic!("{spec}: expected a refusal naming {why:?}, got {other:?}"),
            }
        }
        assert!(help().contains("llama"));
        Ok(())
    }
}
