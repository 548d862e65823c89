//! Matrix multiplication through `matrixmultiply::sgemm`, behind a safe,
//! bounds-checked wrapper.
//!
//! `matrixmultiply` packs its operands and dispatches to SIMD kernels at run
//! time; it is built without its `threading` feature, so one call runs on the
//! calling thread and its summation order is fixed: results are bitwise
//! reproducible for the same inputs on the same machine.

use crate::EngineError;

/// Whether an operand is used as stored or transposed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trans {
    /// Use the matrix as stored (row-major).
    No,
    /// Use the transpose of the stored (row-major) matrix.
    Yes,
}

/// A strided view of a matrix: element `(i, j)` is `data[i * rs + j * cs]`.
#[derive(Debug, Clone, Copy)]
pub struct MatView<'a> {
    /// Backing storage (the view may start at any offset: slice it first).
    pub data: &'a [f32],
    /// Row stride.
    pub rs: usize,
    /// Column stride.
    pub cs: usize,
}

/// Largest index touched by a `rows x cols` view with strides `rs`, `cs`,
/// or `None` when the view is empty (or the index overflows).
fn max_index(rows: usize, cols: usize, rs: usize, cs: usize) -> Option<usize> {
    if rows == 0 || cols == 0 {
        return None;
    }
    (rows - 1).checked_mul(rs)?.checked_add((cols - 1).checked_mul(cs)?)
}

fn check_view(
    what: &'static str,
    len: usize,
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
) -> Result<(), EngineError> {
    if rows == 0 || cols == 0 {
        return Ok(());
    }
    let Some(max) = max_index(rows, cols, rs, cs) else {
        return Err(EngineError::InvalidConfig(format!(
            "{what}: strides ({rs}, {cs}) overflow for a {rows} x {cols} matrix"
        )));
    };
    if max >= len || isize::try_from(rs).is_err() || isize::try_from(cs).is_err() {
        return Err(EngineError::LengthMismatch { what, expected: max.saturating_add(1), got: len });
    }
    Ok(())
}

/// `C = alpha * A * B + beta * C` with strided operands: `A` is `m x k`,
/// `B` is `k x n`, `C` is `m x n` with strides `(rsc, csc)`.
///
/// When `beta == 0`, `C` is not read (NaN in `C` does not propagate).
/// Errors when a view reaches past its slice, or when `C`'s strides would
/// map two elements to the same location.
#[allow(clippy::too_many_arguments)]
pub fn sgemm_strided(
    m: usize,
    k: usize,
    n: usize,
    alpha: f32,
    a: MatView<'_>,
    b: MatView<'_>,
    beta: f32,
    c: &mut [f32],
    rsc: usize,
    csc: usize,
) -> Result<(), EngineError> {
    check_view("gemm A", a.data.len(), m, k, a.rs, a.cs)?;
    check_view("gemm B", b.data.len(), k, n, b.rs, b.cs)?;
    check_view("gemm C", c.len(), m, n, rsc, csc)?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    // C must not alias itself: either row-major-like or column-major-like layout.
    let row_major = csc >= 1 && (m == 1 || rsc >= n.saturating_mul(csc));
    let col_major = rsc >= 1 && (n == 1 || csc >= m.saturating_mul(rsc));
    if !(row_major || col_major) {
        return Err(EngineError::InvalidConfig(format!(
            "gemm C: strides ({rsc}, {csc}) overlap for a {m} x {n} matrix"
        )));
    }
    // The casts cannot wrap: check_view verified every stride fits in isize.
    let (rsa, csa) = (a.rs as isize, a.cs as isize);
    let (rsb, csb) = (b.rs as isize, b.cs as isize);
    let (rsc, csc) = (rsc as isize, csc as isize);
    // SAFETY: check_view proved that every element (i, p) of A (i < m, p < k),
    // (p, j) of B (p < k, j < n) and (i, j) of C lies inside its slice, and
    // that the strides fit in isize, so every pointer sgemm forms stays in
    // bounds (when k == 0, A and B are never read). A and B are shared
    // borrows, C is an exclusive borrow (so it does not alias A or B), and
    // C's strides map distinct (i, j) to distinct elements (checked above),
    // so the writes do not overlap. sgemm is single-threaded here (no
    // `threading` feature), so nothing outlives this call.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            alpha,
            a.data.as_ptr(),
            rsa,
            csa,
            b.data.as_ptr(),
            rsb,
            csb,
            beta,
            c.as_mut_ptr(),
            rsc,
            csc,
        );
    }
    Ok(())
}

/// Row-major `C (m x n) = op(A) * op(B) + beta * C`, where `op(A)` is
/// `m x k` (stored `m x k`, or `k x m` when `ta == Trans::Yes`) and `op(B)`
/// is `k x n` (stored `k x n`, or `n x k` when transposed).
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    ta: Trans,
    tb: Trans,
    m: usize,
    k: usize,
    n: usize,
    a: &[f32],
    b: &[f32],
    beta: f32,
    c: &mut [f32],
) -> Result<(), EngineError> {
    let a = match ta {
        Trans::No => MatView { data: a, rs: k, cs: 1 },
        Trans::Yes => MatView { data: a, rs: 1, cs: m },
    };
    let b = match tb {
        Trans::No => MatView { data: b, rs: n, cs: 1 },
        Trans::Yes => MatView { data: b, rs: 1, cs: k },
    };
    sgemm_strided(m, k, n, 1.0, a, b, beta, c, n, 1)
}
