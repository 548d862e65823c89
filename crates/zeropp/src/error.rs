//! The one error type of the subcommands.

/// Errors from any subcommand, printed as one line.
pub(crate) type CliError = Box<dyn std::error::Error + Send + Sync>;
