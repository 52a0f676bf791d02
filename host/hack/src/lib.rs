//! The workspace hack: a crate with no code whose dependencies turn on, in
//! every build, the features that the test build's dev-dependencies turn on
//! in crates shared with the `wasmem` binary. Cargo resolves features per
//! build; without this crate `cargo run --release` after the test build
//! would compile wasmtime and its dependencies a second time with the smaller
//! feature set (the "workspace-hack" pattern of large Rust workspaces).
