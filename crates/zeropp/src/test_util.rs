//! Helpers of the unit tests of more than one module.

/// Asserts that `parse` refuses every `(spec, says)` of `cases` with an
/// error whose message contains `says`.
pub(crate) fn refused<T>(parse: impl Fn(&str) -> Result<T, crate::error::CliError>, cases: &[(&str, &str)]) {
    for (spec, says) in cases {
        let err = parse(spec).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains(says), "{spec}: {err}");
    }
}
