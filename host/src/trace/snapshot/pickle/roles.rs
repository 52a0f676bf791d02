//! Where in a snapshot a container lies, as far as the import cares.
//!
//! The import reads few parts of a snapshot (see [`super::super`]'s "The
//! snapshot shape"): of the top-level dict `segments` and `device_traces`,
//! of segments their scalars and `blocks`, of blocks and trace entries their
//! scalars and the *first* frame of `frames`, of a frame its `name`. A
//! container built at a place the import never reads — the value of any
//! other key, at any depth below such a value — is [`Role::Unused`]: the
//! reader keeps nothing of it. A `frames` list keeps only its first item.
//!
//! Roles are guessed when a container is created, from the stack: a pickle
//! builds a container before its parent takes it (a list's items between a
//! mark and `APPENDS`, a dict's pairs between a mark and `SETITEMS`, one
//! item or pair right above its container for `APPEND` / `SETITEM`). A wrong
//! guess never changes a result: whatever was not kept is a marked node, and
//! the import parses again, keeping everything, when the walk meets one
//! (see [`super::Pickle::touched_skipped`]).

/// The place of a container in the snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    /// Nothing known: kept whole, and so is everything in it.
    Unknown,
    /// The top level (a dict, or the old format's list of segments).
    Root,
    /// `segments`.
    Segments,
    /// `segments[i]`.
    Segment,
    /// `segments[i].blocks`.
    Blocks,
    /// `segments[i].blocks[j]`.
    Block,
    /// A `frames` list: only its first item is read.
    Frames,
    /// A frame (its `name` is read).
    Frame,
    /// `device_traces`.
    Traces,
    /// `device_traces[d]`.
    DeviceTrace,
    /// `device_traces[d][k]`.
    Entry,
    /// Never read: nothing of it is kept.
    Unused,
}

/// Where a new container goes in its parent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Slot<'a> {
    /// Item `i` of a list.
    Item(usize),
    /// The value of a string key of a dict.
    Key(&'a str),
}

/// The shape a role's container has in a snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Shape {
    /// A list (or tuple).
    List,
    /// A dict.
    Dict,
    /// Anything.
    Any,
}

impl Role {
    /// The shape a container of this role has; a container of another shape
    /// gets [`Role::Unknown`] instead.
    pub(crate) fn shape(self) -> Shape {
        match self {
            Role::Segments | Role::Blocks | Role::Frames | Role::Traces | Role::DeviceTrace => Shape::List,
            Role::Segment | Role::Block | Role::Frame | Role::Entry => Shape::Dict,
            Role::Unknown | Role::Root | Role::Unused => Shape::Any,
        }
    }

    /// The role of a container at `slot` of a container of this role.
    pub(crate) fn child(self, slot: Slot<'_>) -> Role {
        use Role::*;
        match (self, slot) {
            (Unknown, _) => Unknown,
            (Unused, _) => Unused,
            (Root, Slot::Key("segments")) => Segments,
            (Root, Slot::Key("device_traces")) => Traces,
            (Root, Slot::Item(_)) | (Segments, Slot::Item(_)) => Segment,
            (Segment, Slot::Key("blocks")) => Blocks,
            (Blocks, Slot::Item(_)) => Block,
            // A segment's frames are not read, but PyTorch shares them with
            // its first block's: kept like those.
            (Segment | Block | Entry, Slot::Key("frames")) => Frames,
            // Frames after the first are not read, but they are often
            // shared with other lists (where they may come first): kept.
            (Frames, Slot::Item(_)) => Frame,
            (Traces, Slot::Item(_)) => DeviceTrace,
            (DeviceTrace, Slot::Item(_)) => Entry,
            (Root | Segment | Block | Entry | Frame, Slot::Key(_)) => Unused,
            // A list item of a dict role, or a key of a list role.
            _ => Unknown,
        }
    }

    /// This role, if a container of `shape` fits it; else `Unknown`.
    pub(crate) fn fitting(self, shape: Shape) -> Role {
        match self.shape() {
            Shape::Any => self,
            s if s == shape => self,
            _ => Role::Unknown,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_snapshot_schema() {
        let r = Role::Root.child(Slot::Key("segments"));
        assert_eq!(r, Role::Segments);
        let b = r.child(Slot::Item(3)).child(Slot::Key("blocks")).child(Slot::Item(0));
        assert_eq!(b, Role::Block);
        assert_eq!(b.child(Slot::Key("frames")).child(Slot::Item(5)), Role::Frame);
        assert_eq!(b.child(Slot::Key("frames")).child(Slot::Item(0)).child(Slot::Key("filename")), Role::Unused);
        let e = Role::Root.child(Slot::Key("device_traces")).child(Slot::Item(0)).child(Slot::Item(9));
        assert_eq!(e, Role::Entry);
        assert_eq!(e.child(Slot::Key("user_metadata")), Role::Unused);
        assert_eq!(Role::Root.child(Slot::Key("allocator_settings")).child(Slot::Item(1)), Role::Unused);
        assert_eq!(Role::Segments.child(Slot::Key("x")), Role::Unknown);
        assert_eq!(Role::Segment.fitting(Shape::List), Role::Unknown);
        assert_eq!(Role::Unused.fitting(Shape::List), Role::Unused);
    }
}
