//! Errors of loading, instantiating and swapping policies. Each names the
//! policy (its file or its `lifecycle.name`) and the cause.

use std::path::PathBuf;

/// Why a policy could not be loaded or instantiated.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoadError {
    /// The wasmtime engine could not be configured.
    #[error("policy runtime: {0}")]
    Engine(String),
    /// The file could not be read.
    #[error("policy `{policy}`: cannot read {}: {cause}", path.display())]
    Io {
        /// The policy (file name).
        policy: String,
        /// The file.
        path: PathBuf,
        /// The OS error.
        cause: String,
    },
    /// The bytes are not a valid component for this engine.
    #[error("policy `{policy}`: not a valid WebAssembly component: {cause}")]
    Compile {
        /// The policy.
        policy: String,
        /// The compiler's message.
        cause: String,
    },
    /// The component exports or imports a `wasmem:policy` interface of another version.
    #[error(
        "policy `{policy}`: uses `{interface}`, but this engine speaks wasmem:policy@{expected} \
         (rebuild the policy against one of these versions of the WIT package)"
    )]
    WrongVersion {
        /// The policy.
        policy: String,
        /// The interface found.
        interface: String,
        /// The versions this engine speaks.
        expected: String,
    },
    /// The component uses `wasmem:policy` interfaces of two versions.
    #[error(
        "policy `{policy}`: mixes versions of the WIT package: `{first}` and `{second}` \
         (build every interface against one version)"
    )]
    MixedVersions {
        /// The policy.
        policy: String,
        /// The first interface found.
        first: String,
        /// An interface of another version.
        second: String,
    },
    /// The component exports no decision role and no planner.
    #[error(
        "policy `{policy}`: exports none of wasmem:policy/placement, reclamation, eviction or planner @{expected} \
         (its exports: {exports})"
    )]
    NoRole {
        /// The policy.
        policy: String,
        /// What it exports.
        exports: String,
        /// The version this engine speaks.
        expected: String,
    },
    /// The component does not export `lifecycle`.
    #[error("policy `{policy}`: does not export wasmem:policy/lifecycle@{expected}")]
    NoLifecycle {
        /// The policy.
        policy: String,
        /// The version this engine speaks.
        expected: String,
    },
    /// An import of the component is not provided by the engine (or the
    /// exports do not have the types of the WIT package).
    #[error("policy `{policy}`: cannot link: {cause}")]
    Link {
        /// The policy.
        policy: String,
        /// wasmtime's message.
        cause: String,
    },
    /// Instantiation failed (start function trapped, memory over the cap…).
    #[error("policy `{policy}`: cannot instantiate: {cause}")]
    Instantiate {
        /// The policy.
        policy: String,
        /// The cause.
        cause: String,
    },
    /// A lifecycle call (`init`, `pools`, `name`) failed.
    #[error("policy `{policy}`: `{call}` failed: {cause}")]
    Lifecycle {
        /// The policy.
        policy: String,
        /// The call.
        call: &'static str,
        /// The cause (a trap, a limit, or the policy's own error text).
        cause: String,
    },
}

impl LoadError {
    pub(crate) fn lifecycle(policy: &str, call: &'static str, cause: impl std::fmt::Display) -> Self {
        LoadError::Lifecycle { policy: policy.to_string(), call, cause: cause.to_string() }
    }
}
