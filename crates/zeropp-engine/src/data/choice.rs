//! Loading the training text: a [`DataChoice`] becomes a [`TextDataset`] and a
//! one-line [`DataInfo`] the CLI prints before training.

use crate::EngineError;
use crate::data::{DataInfo, MarkovSource, TextDataset};

use super::DataChoice;

/// Loads the data of `choice`.
///
/// ```
/// use zeropp_engine::train::{DataChoice, load_data};
/// let (data, info) = load_data(&DataChoice::Text("abcabcabd".repeat(20)))?;
/// assert_eq!(info.vocab, 4);
/// assert_eq!(data.vocab_size(), 4);
/// assert!(info.entropy_rate.is_none());
/// # Ok::<(), zeropp_engine::EngineError>(())
/// ```
pub fn load_data(choice: &DataChoice) -> Result<(TextDataset, DataInfo), EngineError> {
    let (ds, description, entropy) = match choice {
        DataChoice::Markov { seed, chars } => {
            let src = MarkovSource::new(*seed);
            let ds = TextDataset::generated(&src, *chars, *seed)?;
            let h = src.entropy_rate_nats();
            (ds, format!("generated Markov text ({chars} chars, seed {seed})"), Some(h))
        }
        DataChoice::File(p) => (TextDataset::from_file(p)?, format!("{}", p.display()), None),
        DataChoice::Text(t) => (TextDataset::from_text(t)?, "inline text".to_string(), None),
    };
    let info = DataInfo {
        description,
        entropy_rate: entropy,
        vocab: ds.vocab_size(),
        train_tokens: ds.train_tokens().len(),
    };
    Ok((ds, info))
}
