//! `--model llama[:d=,layers=,heads=,kv_heads=,seq=,ff=,tie=]`: the candle Llama
//! decoder of `zeropp-candle`, parsed here (the CLI only parses; the model and
//! its training are `zeropp-candle`'s and the engine's).

use zeropp_candle::{CandleModel, LlamaConfig};

use crate::CliError;

/// A Llama shape from `--model`, before the data fixes the vocabulary.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct LlamaShape {
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
    pub(crate) fn build(&self, vocab: usize) -> Result<CandleModel, CliError> {
        let mut c = LlamaConfig::shape(vocab, self.d, self.layers, self.heads, self.kv_heads, self.seq);
        if let Some(ff) = self.ff {
            c.d_ff = ff;
        }
        c.tie_word_embeddings = self.tie;
        Ok(c.build()?)
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

/// `Some(shape)` when `spec` names the Llama (`llama` or `llama:KEY=VALUE,...`).
pub(crate) fn parse(spec: &str) -> Result<Option<LlamaShape>, CliError> {
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
            return Err(format!("--model: `{kv}` in `{spec}` is not key=value").into());
        };
        let (k, v) = (k.trim(), v.trim());
        if matches!(k.to_ascii_lowercase().as_str(), "tie" | "tie_word_embeddings") {
            s.tie = match v {
                "1" | "true" => true,
                "0" | "false" => false,
                _ => return Err(format!("--model: `{k}={v}` must be 0 or 1").into()),
            };
            continue;
        }
        let value = v
            .parse::<usize>()
            .ok()
            .filter(|&x| x > 0)
            .ok_or_else(|| format!("--model: `{k}={v}` is not a positive integer"))?;
        match k.to_ascii_lowercase().as_str() {
            "d" | "hidden_size" => s.d = value,
            "layers" | "num_hidden_layers" => s.layers = value,
            "heads" | "num_attention_heads" => s.heads = value,
            "kv_heads" | "num_key_value_heads" => s.kv_heads = value,
            "seq" | "seq_len" => s.seq = value,
            "ff" | "intermediate_size" => s.ff = Some(value),
            _ => {
                return Err(format!(
                    "--model: unknown key `{k}` in `{spec}` (expected d, layers, heads, kv_heads, seq, ff or tie)"
                )
                .into());
            }
        }
    }
    // The sizes are checked now, with a placeholder vocabulary.
    LlamaConfig::shape(256, s.d, s.layers, s.heads, s.kv_heads, s.seq)
        .validate()
        .map_err(|e| format!("--model `{spec}`: {e}"))?;
    Ok(Some(s))
}

/// The help line of the Llama.
pub(crate) fn help() -> String {
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
    fn llama_specs_parse_and_bad_ones_say_why() -> Result<(), CliError> {
        assert_eq!(parse("gpt")?, None);
        assert_eq!(parse("llama")?, Some(DEFAULT));
        let s = parse("llama:d=128,layers=3,heads=8,kv_heads=4,seq=32,ff=256")?.ok_or("llama")?;
        assert_eq!((s.d, s.layers, s.heads, s.kv_heads, s.seq, s.ff), (128, 3, 8, 4, 32, Some(256)));
        assert!(!s.tie && parse("llama:tie=1")?.ok_or("llama")?.tie);
        // A tied head is not stored: the parameter count drops by vocab x d.
        assert_eq!(DEFAULT.params() - parse("llama:tie=1")?.ok_or("llama")?.params(), 256 * DEFAULT.d);
        crate::test_util::refused(
            parse,
            &[
                ("llama:d=63", "multiple of heads"),
                ("llama:heads=4,kv_heads=3", "kv_heads"),
                ("llama:depth=3", "unknown key `depth`"),
                ("llama:d=x", "not a positive integer"),
                ("llama:d", "not key=value"),
                ("llama:tie=2", "must be 0 or 1"),
            ],
        );
        assert!(help().contains("llama"));
        Ok(())
    }
}
