//! Placeholder: replaced by the Redlock latency benchmark.
fn main() {}
