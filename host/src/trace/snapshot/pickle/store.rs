//! How a parsed pickle is held: 8-byte values, 16-byte nodes, and the items
//! of every container in two shared arenas.
//!
//! - A [`Val`] is a scalar inline (`None`, bools, integers of up to 61
//!   bits) or an index: of a [`Node`], of a wide integer, of a float.
//! - A container node holds a [`Span`] of the item arena (lists, tuples,
//!   sets) or of the pair arena (dicts), so an empty container costs no
//!   item storage and no allocation of its own. A span grows in place while
//!   it ends the arena; otherwise it moves to the end with twice the room
//!   (each container's garbage is at most its final capacity).
//! - Strings are ranges of the input unless they had to be decoded.
//!
//! Invariants: a span lies inside its arena, `len ≤ cap`; a `Head` span
//! stores `min(len, 1)` items; node `i` has role `roles[i]`.

use std::cell::Cell;

use super::roles::Role;

/// Index of a [`Node`].
pub(crate) type NodeId = u32;

/// No node (a [`Node::Global`] part that was not a string).
pub(crate) const NO_NODE: NodeId = NodeId::MAX;

/// Classes whose instances are read as dicts even when the pickle gives
/// them no items (an empty `OrderedDict`).
const MAPPING_CLASSES: [&str; 5] =
    ["collections.OrderedDict", "collections.defaultdict", "collections.Counter", "builtins.dict", "__builtin__.dict"];

/// Classes whose instances are read as lists: their items are the pickle's
/// `APPEND`s, or the first argument of the constructor call
/// (`set([1, 2])` in protocols 2 and 3).
const SEQUENCE_CLASSES: [&str; 9] = [
    "builtins.list",
    "builtins.tuple",
    "builtins.set",
    "builtins.frozenset",
    "collections.deque",
    "__builtin__.list",
    "__builtin__.tuple",
    "__builtin__.set",
    "__builtin__.frozenset",
];

/// A value in 8 bytes: a 3-bit tag, then the payload.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Val(u64);

const TAG_BITS: u32 = 3;
const TAG: u64 = (1 << TAG_BITS) - 1;
const T_NODE: u64 = 0;
const T_INT: u64 = 1;
const T_SPECIAL: u64 = 2;
const T_WIDE: u64 = 3;
const T_FLOAT: u64 = 4;
/// Integers stored inline: `-2**60 ≤ i < 2**60`.
const INLINE_MIN: i64 = -(1 << 60);
const INLINE_MAX: i64 = (1 << 60) - 1;

impl Val {
    /// Python's `None`.
    pub(crate) const NONE: Val = Val(T_SPECIAL);
    /// `False`.
    pub(crate) const FALSE: Val = Val(1 << TAG_BITS | T_SPECIAL);
    /// `True`.
    pub(crate) const TRUE: Val = Val(2 << TAG_BITS | T_SPECIAL);
    /// An integer that does not fit `i64` (its digits are not kept).
    pub(crate) const BIG_INT: Val = Val(3 << TAG_BITS | T_SPECIAL);
    /// Not a value: an empty memo slot, an unused arena slot.
    pub(crate) const HOLE: Val = Val(4 << TAG_BITS | T_SPECIAL);

    /// A reference to node `id`.
    pub(crate) fn node(id: NodeId) -> Val {
        Val(u64::from(id) << TAG_BITS | T_NODE)
    }

    /// An integer stored in the value itself, if it fits 61 bits.
    pub(crate) fn inline_int(i: i64) -> Option<Val> {
        (INLINE_MIN..=INLINE_MAX).contains(&i).then_some(Val((i << TAG_BITS) as u64 | T_INT))
    }

    /// An integer stored at `index` of [`Store::wide`].
    pub(crate) fn wide_int(index: u32) -> Val {
        Val(u64::from(index) << TAG_BITS | T_WIDE)
    }

    /// A float stored at `index` of [`Store::floats`].
    pub(crate) fn float(index: u32) -> Val {
        Val(u64::from(index) << TAG_BITS | T_FLOAT)
    }

    /// The node this value refers to.
    pub(crate) fn as_node(self) -> Option<NodeId> {
        (self.0 & TAG == T_NODE).then_some((self.0 >> TAG_BITS) as NodeId)
    }
}

impl std::fmt::Debug for Val {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 & TAG {
            T_NODE => write!(f, "Node({})", self.0 >> TAG_BITS),
            T_INT => write!(f, "Int({})", self.0 as i64 >> TAG_BITS),
            T_WIDE => write!(f, "WideInt#{}", self.0 >> TAG_BITS),
            T_FLOAT => write!(f, "Float#{}", self.0 >> TAG_BITS),
            _ => f.write_str(match *self {
                Val::NONE => "None",
                Val::FALSE => "False",
                Val::TRUE => "True",
                Val::BIG_INT => "BigInt",
                _ => "Hole",
            }),
        }
    }
}

/// A value as a reader sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Scalar {
    /// `None`.
    None,
    /// A bool.
    Bool(bool),
    /// An integer that fits `i64`.
    Int(i64),
    /// An integer that does not.
    BigInt,
    /// A float.
    Float(f64),
    /// Something in the arena.
    Node(NodeId),
}

/// A container's items: `len` used of `cap` reserved from `start`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Span {
    pub(crate) start: u32,
    pub(crate) len: u32,
    pub(crate) cap: u32,
}

/// A string's text.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Text {
    /// Bytes of the input (validated as UTF-8).
    Input { start: u32, len: u32 },
    /// Decoded text, in [`Store::owned`].
    Owned(u32),
}

/// The kinds of container a skipped one stands for (so that filling it
/// fails exactly as filling the real one would).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    List,
    Tuple,
    Set,
    Dict,
    Object,
}

impl Kind {
    /// Every kind, in the order of the skipped nodes that start the arena.
    pub(crate) const ALL: [Kind; 5] = [Kind::List, Kind::Tuple, Kind::Set, Kind::Dict, Kind::Object];

    /// The shared node that stands for every skipped container of this kind.
    pub(crate) fn skipped(self) -> NodeId {
        self as NodeId
    }
}

/// An object in the arena.
#[derive(Debug)]
pub(crate) enum Node {
    Str(Text),
    /// A `bytes` or `bytearray` (its contents are not kept).
    Bytes,
    List(Span),
    /// A list of which only the first item is stored (`len` counts all).
    Head(Span),
    Tuple(Span),
    Set(Span),
    /// Pairs in [`Store::pairs`].
    Dict(Span),
    /// A reference to a class or function (never resolved): the nodes of
    /// its module and name strings ([`NO_NODE`] where the pickle gave
    /// something else).
    Global {
        module: NodeId,
        name: NodeId,
    },
    /// An instance built by `REDUCE`/`NEWOBJ`/`OBJ`/`INST`/`BUILD`.
    Object(Box<Object>),
    /// Something else opaque (persistent ids, extension codes, buffers).
    Opaque,
    /// Stands for every container of this kind the reader did not keep.
    Skipped(Kind),
}

const _: () = assert!(std::mem::size_of::<Val>() == 8 && std::mem::size_of::<Node>() == 16);

/// The parts of an opaque instance that the pickle gives it.
#[derive(Debug, Default)]
pub(crate) struct Object {
    /// Items set on it as if it were a dict (`SETITEM(S)`).
    pub(crate) items: Vec<(Val, Val)>,
    /// Items appended to it as if it were a list (`APPEND(S)`, `ADDITEMS`).
    pub(crate) list: Vec<Val>,
    /// Its `__setstate__` argument (`BUILD`).
    pub(crate) state: Option<Val>,
    /// The class or function that would build it (never called).
    pub(crate) class: Option<Val>,
    /// The arguments it would be called with (`REDUCE`, `NEWOBJ`).
    pub(crate) args: Option<Val>,
}

/// The arena of a parsed pickle.
#[derive(Debug, Default)]
pub(crate) struct Store {
    pub(crate) nodes: Vec<Node>,
    pub(crate) roles: Vec<Role>,
    pub(crate) items: Vec<Val>,
    pub(crate) pairs: Vec<(Val, Val)>,
    pub(crate) owned: Vec<Box<str>>,
    pub(crate) wide: Vec<i64>,
    pub(crate) floats: Vec<f64>,
}

/// A parsed pickle: the arena and the root value.
pub(crate) struct Pickle<'a> {
    pub(crate) input: &'a [u8],
    pub(crate) store: Store,
    /// The value the pickle stops with.
    pub(crate) root: Val,
    /// Whether a reader met a container the parse did not keep.
    pub(crate) touched: Cell<bool>,
}

impl<'a> Pickle<'a> {
    /// What `v` is.
    pub(crate) fn scalar(&self, v: Val) -> Scalar {
        let payload = v.0 >> TAG_BITS;
        match v.0 & TAG {
            T_NODE => Scalar::Node(payload as NodeId),
            T_INT => Scalar::Int(v.0 as i64 >> TAG_BITS),
            T_WIDE => self.store.wide.get(payload as usize).map_or(Scalar::BigInt, |&i| Scalar::Int(i)),
            T_FLOAT => Scalar::Float(self.store.floats.get(payload as usize).copied().unwrap_or(f64::NAN)),
            _ => match v {
                Val::FALSE => Scalar::Bool(false),
                Val::TRUE => Scalar::Bool(true),
                Val::BIG_INT => Scalar::BigInt,
                _ => Scalar::None,
            },
        }
    }

    /// The node `v` refers to; a skipped one is noted (see
    /// [`Pickle::touched_skipped`]).
    fn node(&self, v: Val) -> Option<&Node> {
        let n = self.store.nodes.get(v.as_node()? as usize)?;
        if matches!(n, Node::Skipped(_) | Node::Head(_)) {
            self.touched.set(true);
        }
        Some(n)
    }

    /// Whether a reader asked for a container the parse did not keep (whole):
    /// its answers may then be wrong, and the import parses again keeping
    /// everything.
    pub(crate) fn touched_skipped(&self) -> bool {
        self.touched.get()
    }

    /// The text of a `str`.
    pub(crate) fn as_str(&self, v: Val) -> Option<&str> {
        match self.node(v)? {
            Node::Str(Text::Owned(i)) => self.store.owned.get(*i as usize).map(|s| &**s),
            Node::Str(Text::Input { start, len }) => {
                let (s, l) = (*start as usize, *len as usize);
                // Validated as UTF-8 when parsed.
                std::str::from_utf8(self.input.get(s..s + l)?).ok()
            }
            _ => None,
        }
    }

    /// The value of an `int` that fits `i64`.
    pub(crate) fn as_int(&self, v: Val) -> Option<i64> {
        match self.scalar(v) {
            Scalar::Int(i) => Some(i),
            _ => None,
        }
    }

    fn items(&self, s: &Span) -> &[Val] {
        self.store.items.get(s.start as usize..(s.start + s.len) as usize).unwrap_or(&[])
    }

    fn pairs(&self, s: &Span) -> &[(Val, Val)] {
        self.store.pairs.get(s.start as usize..(s.start + s.len) as usize).unwrap_or(&[])
    }

    /// The items of a list, tuple or set (or of an object filled like a list).
    pub(crate) fn as_list(&self, v: Val) -> Option<&[Val]> {
        match self.node(v)? {
            Node::List(s) | Node::Tuple(s) | Node::Set(s) => Some(self.items(s)),
            Node::Object(o) if !o.list.is_empty() => Some(&o.list),
            Node::Object(o) => match o.state.and_then(|s| self.node(s)) {
                Some(Node::List(s)) => Some(self.items(s)),
                _ if self.class_in(o, &SEQUENCE_CLASSES) => {
                    // `cls(items)`: the items of the first argument, when
                    // the arguments are a tuple and it is a list, tuple or
                    // set (never another object: no recursion).
                    let first = match o.args.and_then(|a| self.node(a)) {
                        Some(Node::Tuple(s)) => self.items(s).first().copied(),
                        _ => None,
                    };
                    Some(match first.and_then(|f| self.node(f)) {
                        Some(Node::List(s) | Node::Tuple(s) | Node::Set(s)) => self.items(s),
                        _ => &[],
                    })
                }
                _ => None,
            },
            _ => None,
        }
    }

    /// The `module.name` of the class of an object, if the pickle named it
    /// with strings.
    pub(crate) fn class_name(&self, o: &Object) -> Option<String> {
        let Some(Node::Global { module, name }) = o.class.and_then(|c| self.store.nodes.get(c.as_node()? as usize))
        else {
            return None;
        };
        let text = |id: NodeId| self.as_str(Val::node(id)).filter(|_| id != NO_NODE);
        Some(format!("{}.{}", text(*module)?, text(*name)?))
    }

    fn class_in(&self, o: &Object, names: &[&str]) -> bool {
        self.class_name(o).is_some_and(|c| names.contains(&c.as_str()))
    }

    /// The first item of what [`as_list`](Self::as_list) would return, also
    /// for a list of which the parse kept only the first item.
    pub(crate) fn first_item(&self, v: Val) -> Option<Val> {
        if let Some(Node::Head(s)) = v.as_node().and_then(|i| self.store.nodes.get(i as usize)) {
            return (s.len > 0).then(|| self.store.items.get(s.start as usize).copied()).flatten();
        }
        self.as_list(v)?.first().copied()
    }

    /// The pairs of a dict (or of an object filled like a dict, or whose
    /// state is a dict, such as an `OrderedDict`).
    pub(crate) fn as_dict(&self, v: Val) -> Option<&[(Val, Val)]> {
        match self.node(v)? {
            Node::Dict(s) => Some(self.pairs(s)),
            Node::Object(o) if !o.items.is_empty() => Some(&o.items),
            Node::Object(o) => match o.state.and_then(|s| self.node(s)) {
                Some(Node::Dict(s)) => Some(self.pairs(s)),
                // An empty mapping; an empty object of another class is not
                // taken for a dict.
                _ if o.list.is_empty() && self.class_in(o, &MAPPING_CLASSES) => Some(&o.items),
                _ => None,
            },
            _ => None,
        }
    }

    /// A short Python-ish name of the value's type, for error messages: the
    /// type it has in Python (an object's class when the pickle names it,
    /// printable characters only, at most 100 of them).
    pub(crate) fn type_name(&self, v: Val) -> std::borrow::Cow<'static, str> {
        if let Some(Node::Object(o)) = v.as_node().and_then(|i| self.store.nodes.get(i as usize)) {
            if let Some(class) = self.class_name(o) {
                let printable: String = class.chars().filter(|c| !c.is_control()).take(100).collect();
                return format!("{printable} object").into();
            }
        }
        let name = match self.scalar(v) {
            Scalar::None => "None",
            Scalar::Bool(_) => "bool",
            Scalar::Int(_) => "int",
            Scalar::BigInt => "int (too large)",
            Scalar::Float(_) => "float",
            Scalar::Node(_) => match self.node(v) {
                Some(Node::Str(_)) => "str",
                Some(Node::Bytes) => "bytes",
                Some(Node::List(_) | Node::Head(_) | Node::Skipped(Kind::List)) => "list",
                Some(Node::Tuple(_) | Node::Skipped(Kind::Tuple)) => "tuple",
                Some(Node::Dict(_) | Node::Skipped(Kind::Dict)) => "dict",
                Some(Node::Set(_) | Node::Skipped(Kind::Set)) => "set",
                Some(Node::Global { .. }) => "class",
                Some(Node::Object(_) | Node::Skipped(Kind::Object)) => "object",
                Some(Node::Opaque) | None => "opaque object",
            },
        };
        name.into()
    }
}
