//! [`DataInfo`]: what a run says of its data.

use super::TextDataset;

/// A one-line description of the data and its loss floor, for the CLI to print first.
#[derive(Debug, Clone, PartialEq)]
pub struct DataInfo {
    /// Human-readable description.
    pub description: String,
    /// Entropy rate in nats (the loss floor) for generated text.
    pub entropy_rate: Option<f64>,
    /// Vocabulary size.
    pub vocab: usize,
    /// Training tokens.
    pub train_tokens: usize,
}

impl DataInfo {
    /// The description of a dataset a caller built itself: `description`,
    /// its vocabulary and training tokens, no known loss floor.
    pub fn of(data: &TextDataset, description: impl Into<String>) -> Self {
        Self {
            description: description.into(),
            entropy_rate: None,
            vocab: data.vocab_size(),
            train_tokens: data.train_tokens().len(),
        }
    }
}
