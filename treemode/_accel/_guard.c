/* treemode's optional compiled call path (imported only by treemode/_accel/_compiled.py).
 *
 * Every function here executes what the Python code decided and also
 * implements (its Python twins are named in each docstring); nothing here knows
 * a private Flax or JAX name: `configure` receives, once, the Variable slots and
 * JAX trace state that treemode/_compat.py verified, and the Python objects the
 * call path compares with or calls back (see the records in _compiled.py). The
 * names read below (`_fast`, `writable_in`, `variables`, `metadata_updates`,
 * `write_back`, `_call`) are treemode's own.
 *
 * Identity checks behind treemode's flattening cache (see treemode/_tree/_flatten.py).
 *
 * A cached flattening of an argument stays valid while every container it
 * walked through still holds the very same objects. `_Guard` in _flatten.py
 * snapshots those containers; `holds` below compares the snapshot with their
 * current contents by pointer, in one pass, without calling any Python code
 * except one attribute read per Variable. The saved snapshot keeps every saved
 * object alive, so equal pointers mean the same object.
 *
 * Optional: when this module is not built, _flatten.py runs the same checks in
 * Python.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h> /* T_OBJECT_EX */

static PyObject *fast_name;      /* interned "_fast" */
static PyObject *code_name;      /* interned "__code__" */
static PyObject *closure_name;   /* interned "__closure__" */
static PyObject *call_name;      /* interned "call" */
static PyObject *write_back_name; /* interned "write_back" */
static PyObject *slow_call_name; /* interned "_call" */
static PyObject *metadata_updates_name; /* interned "metadata_updates" */
static PyObject *writable_in_name; /* interned "writable_in" */
static PyObject *variables_name; /* interned "variables" */
static PyObject *dict_name;      /* interned "__dict__" */
static PyObject *getattribute_name; /* interned "__getattribute__" */

/* The configuration (see `configure`): the two records, held, and their
 * fields (borrowed from them). */
static PyObject *config_layout, *config_call_path;
static PyObject *raw_value_member;   /* Variable._raw_value's member descriptor */
static PyObject *metadata_member;    /* Variable._var_metadata's member descriptor */
static PyObject *raw_value_name, *metadata_name; /* their names */
static PyObject *current_trace;      /* its `current_trace_attr`: the current trace's weakref */
static PyObject *current_trace_attr;
static PyObject *cfg_array_types, *cfg_match_slow, *cfg_kinds, *cfg_ignore, *cfg_empty,
    *cfg_ignored, *cfg_raise_failure, *cfg_store_owner, *cfg_store_name, *cfg_default_store;
static PyTypeObject *cfg_site_call;

/* 0 (with a RuntimeError) until `configure` was called. */
static int
configured(void)
{
    if (config_layout != NULL)
        return 1;
    PyErr_SetString(PyExc_RuntimeError,
                    "treemode._accel._guard: configure() was not called (import treemode first)");
    return 0;
}

/* Dict version tags (CPython 3.11: `ma_version_tag` changes whenever a dict is
 * modified). A dict whose tag is the one saved with a snapshot has not been
 * modified since, so its contents need no comparison. Where tags are not
 * available (3.12 deprecated them), `version_tags` returns None and every
 * comparison is made. */
#if PY_VERSION_HEX < 0x030C0000
#define HAVE_VERSION_TAGS 1
#else
#define HAVE_VERSION_TAGS 0
#endif

/* The saved tags of a snapshot's `n` containers (a bytes of n uint64), or NULL. */
static const uint64_t *
saved_tags(PyObject *tags, Py_ssize_t n)
{
    if (!HAVE_VERSION_TAGS || tags == NULL || !PyBytes_Check(tags) ||
        PyBytes_GET_SIZE(tags) != n * (Py_ssize_t)sizeof(uint64_t))
        return NULL;
    return (const uint64_t *)PyBytes_AS_STRING(tags);
}

/* Whether `container` is a dict not modified since its tag `saved` was read. */
static int
unmodified(PyObject *container, const uint64_t *tags, Py_ssize_t i)
{
#if HAVE_VERSION_TAGS
    return tags != NULL && PyDict_Check(container) &&
           ((PyDictObject *)container)->ma_version_tag == tags[i];
#else
    (void)container;
    (void)tags;
    (void)i;
    return 0;
#endif
}

PyDoc_STRVAR(version_tags_doc,
"version_tags(containers) -> bytes | None\n\n"
"The current version tag of each dict in `containers` (0 for anything else),\n"
"packed as uint64 for a guard state; None where the interpreter has none.\n"
"Read the tags before the contents they vouch for.");

static PyObject *
version_tags(PyObject *Py_UNUSED(module), PyObject *containers)
{
#if HAVE_VERSION_TAGS
    PyObject *seq = PySequence_Fast(containers, "version_tags: a sequence of containers");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *tags = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(uint64_t));
    if (tags != NULL) {
        uint64_t *out = (uint64_t *)PyBytes_AS_STRING(tags);
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *c = PySequence_Fast_GET_ITEM(seq, i);
            out[i] = PyDict_Check(c) ? ((PyDictObject *)c)->ma_version_tag : 0;
        }
    }
    Py_DECREF(seq);
    return tags;
#else
    if (!PyList_Check(containers) && !PyTuple_Check(containers)) {
        PyErr_SetString(PyExc_TypeError, "version_tags: a sequence of containers");
        return NULL;
    }
    Py_RETURN_NONE;
#endif
}

static int
malformed(const char *message)
{
    PyErr_SetString(PyExc_TypeError, message);
    return -1;
}

/* Whether `container` (a dict or a list) has `expected` entries: 1, 0, or -1. */
static int
same_length(PyObject *container, PyObject *expected)
{
    if (!(PyDict_Check(container) || PyList_Check(container)) || !PyLong_Check(expected))
        return malformed("a guard state's sized containers are dicts or lists, lengths ints");
    Py_ssize_t n = PyDict_Check(container) ? PyDict_GET_SIZE(container)
                                           : PyList_GET_SIZE(container);
    Py_ssize_t want = PyLong_AsSsize_t(expected);
    if (want == -1 && PyErr_Occurred())
        return -1;
    return want == n;
}

/* Whether iterating `container` (a dict's keys, or a list's items) gives
 * items[*k], items[*k + 1], ... by identity; advances *k. -1 if malformed. */
static int
same_iteration(PyObject *container, PyObject *items, Py_ssize_t *k)
{
    if (!PyDict_Check(container) && !PyList_Check(container))
        return malformed("a guard state's ordered containers are dicts or lists");
    Py_ssize_t total = PyTuple_GET_SIZE(items);
    if (PyDict_Check(container)) {
        Py_ssize_t pos = 0;
        PyObject *key, *value;
        while (PyDict_Next(container, &pos, &key, &value)) {
            if (*k >= total || key != PyTuple_GET_ITEM(items, *k))
                return 0;
            (*k)++;
        }
        return 1;
    }
    Py_ssize_t n = PyList_GET_SIZE(container);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (*k >= total || PyList_GET_ITEM(container, i) != PyTuple_GET_ITEM(items, *k))
            return 0;
        (*k)++;
    }
    return 1;
}

/* Whether the values of `dict` are values[*k], values[*k + 1], ...; advances *k. */
static int
same_values(PyObject *dict, PyObject *values, Py_ssize_t *k)
{
    if (!PyDict_Check(dict))
        return malformed("a guard state's value-checked containers are dicts");
    Py_ssize_t total = PyTuple_GET_SIZE(values);
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(dict, &pos, &key, &value)) {
        if (*k >= total || value != PyTuple_GET_ITEM(values, *k))
            return 0;
        (*k)++;
    }
    return 1;
}

/* Whether `dict` holds exactly the (key, value) pairs of `entries`, a tuple
 * (k0, v0, k1, v1, ...), in order and by identity. */
static int
same_entries(PyObject *dict, PyObject *entries)
{
    if (2 * PyDict_GET_SIZE(dict) != PyTuple_GET_SIZE(entries))
        return 0;
    Py_ssize_t pos = 0, k = 0;
    PyObject *key, *value;
    while (PyDict_Next(dict, &pos, &key, &value)) {
        if (key != PyTuple_GET_ITEM(entries, k) || value != PyTuple_GET_ITEM(entries, k + 1))
            return 0;
        k += 2;
    }
    return 1;
}

/* Where a Variable type keeps an attribute defined by `__slots__`: the slot's
 * offset, or -1 to read it with getattr. Resolved once per type and attribute;
 * the types are held (a few Variable classes), so a cached address is never
 * another type's. */
#define SLOT_CACHE_SIZE 32
typedef struct {
    PyTypeObject *types[SLOT_CACHE_SIZE];
    Py_ssize_t offsets[SLOT_CACHE_SIZE];
    int n;
} SlotCache;

static SlotCache metadata_slots, raw_value_slots, fast_slots, writable_in_slots, variables_slots;

/* The offset of `descr`'s slot in instances of `type`, if `descr` is a
 * `__slots__` member descriptor (an object slot) of `type` or of a base: else -1. */
static Py_ssize_t
member_offset(PyTypeObject *type, PyObject *descr)
{
    if (descr == NULL || !Py_IS_TYPE(descr, &PyMemberDescr_Type))
        return -1;
    PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
    if (member->type != T_OBJECT_EX || (member->flags & READONLY) ||
        !PyType_IsSubtype(type, PyDescr_TYPE(descr)))
        return -1;
    return member->offset;
}

/* Resolves `name` on `type` once: its slot's offset if the class attribute is
 * an object slot's member descriptor (and, when `expected` is not NULL, that
 * very descriptor), else -1. */
static Py_ssize_t
slot_offset_of(PyTypeObject *type, PyObject *name, PyObject *expected, SlotCache *cache)
{
    for (int i = 0; i < cache->n; i++) {
        if (cache->types[i] == type)
            return cache->offsets[i];
    }
    Py_ssize_t offset = -1;
    /* On the class, a slot's member descriptor returns itself. */
    PyObject *descr = PyObject_GetAttr((PyObject *)type, name);
    if (descr == NULL) {
        PyErr_Clear();
    }
    else {
        if (expected == NULL || descr == expected)
            offset = member_offset(type, descr);
        Py_DECREF(descr);
    }
    if (cache->n < SLOT_CACHE_SIZE) {
        Py_INCREF(type);
        cache->types[cache->n] = type;
        cache->offsets[cache->n] = offset;
        cache->n++;
    }
    return offset;
}

/* treemode's own slots (`_fast`, `writable_in`, `variables`). */
static Py_ssize_t
slot_offset(PyTypeObject *type, PyObject *name, SlotCache *cache)
{
    return slot_offset_of(type, name, NULL, cache);
}

/* The Variable slots `configure` named: read or written in place when `type`
 * inherits that very slot, else with getattr / setattr by name. */
static Py_ssize_t
raw_value_offset(PyTypeObject *type)
{
    return slot_offset_of(type, raw_value_name, raw_value_member, &raw_value_slots);
}

static Py_ssize_t
metadata_offset(PyTypeObject *type)
{
    return slot_offset_of(type, metadata_name, metadata_member, &metadata_slots);
}

static void
slot_cache_clear(SlotCache *cache)
{
    for (int i = 0; i < cache->n; i++)
        Py_CLEAR(cache->types[i]);
    cache->n = 0;
}

/* `obj.name` (a new reference), read from its `__slots__` slot when its type
 * has one there, else with getattr. */
static PyObject *
slot_get(PyObject *obj, PyObject *name, SlotCache *cache)
{
    Py_ssize_t offset = slot_offset(Py_TYPE(obj), name, cache);
    if (offset >= 0) {
        PyObject *value = *(PyObject **)((char *)obj + offset);
        if (value != NULL) {
            Py_INCREF(value);
            return value;
        }
    }
    return PyObject_GetAttr(obj, name); /* unset: raises AttributeError as usual */
}

/* `obj.__dict__` without an attribute lookup, where that gives the same object.
 *
 * For a class defined in Python whose `__dict__` attribute is the one every
 * such class gets (and that neither overrides `__getattribute__` nor derives
 * from a built-in type with its own dict), `obj.__dict__` is exactly
 * `PyObject_GenericGetDict(obj)`. Decided once per type (`dict_access`); any
 * other type is read with getattr, so the answer is always `obj.__dict__`. */
static getter plain_dict_getter;          /* the `__dict__` getter of Python classes */
static PyObject *object_getattribute;     /* object.__getattribute__ (borrowed: static type) */
static SlotCache dict_access;             /* "offsets": 1 generic, 0 getattr */

static int
init_dict_access(void)
{
    PyObject *cls = PyObject_CallFunction((PyObject *)&PyType_Type, "s(O){}", "_Plain",
                                          (PyObject *)&PyBaseObject_Type);
    if (cls == NULL)
        return -1;
    PyObject *descr = _PyType_Lookup((PyTypeObject *)cls, dict_name); /* borrowed */
    if (descr != NULL && Py_IS_TYPE(descr, &PyGetSetDescr_Type))
        plain_dict_getter = ((PyGetSetDescrObject *)descr)->d_getset->get; /* a static function */
    Py_DECREF(cls);
    object_getattribute = _PyType_Lookup(&PyBaseObject_Type, getattribute_name);
    return 0;
}

static int
generic_dict_type(PyTypeObject *type)
{
    for (int i = 0; i < dict_access.n; i++) {
        if (dict_access.types[i] == type)
            return (int)dict_access.offsets[i];
    }
    int generic = 0;
    PyObject *descr = _PyType_Lookup(type, dict_name); /* borrowed; no exception set */
    if (plain_dict_getter != NULL && object_getattribute != NULL && descr != NULL &&
        Py_IS_TYPE(descr, &PyGetSetDescr_Type) &&
        ((PyGetSetDescrObject *)descr)->d_getset->get == plain_dict_getter &&
        _PyType_Lookup(type, getattribute_name) == object_getattribute) {
        generic = 1;
        for (PyTypeObject *base = type; base != NULL; base = base->tp_base) {
            if (!(base->tp_flags & Py_TPFLAGS_HEAPTYPE) && base->tp_dictoffset != 0)
                generic = 0; /* a built-in base keeps the dict: its own getter runs */
        }
    }
    if (dict_access.n < SLOT_CACHE_SIZE) {
        Py_INCREF(type);
        dict_access.types[dict_access.n] = type;
        dict_access.offsets[dict_access.n] = generic;
        dict_access.n++;
    }
    return generic;
}

/* Whether `obj.__dict__` is `expected`: 1, 0, or -1 with the exception raised. */
static int
dict_is(PyObject *obj, PyObject *expected)
{
    PyObject *current = generic_dict_type(Py_TYPE(obj)) ? PyObject_GenericGetDict(obj, NULL)
                                                        : PyObject_GetAttr(obj, dict_name);
    if (current == NULL)
        return -1;
    Py_DECREF(current); /* only compared; `expected` keeps the saved dict alive */
    return current == expected;
}

/* Whether `var`'s `_var_metadata` is `expected`, holding exactly `entries`. */
static int
same_metadata(PyObject *var, PyObject *expected, PyObject *entries, const uint64_t *tags,
              Py_ssize_t i)
{
    if (!PyTuple_Check(entries))
        return malformed("a guard state's metadata entries are tuples");
    Py_ssize_t offset = metadata_offset(Py_TYPE(var));
    if (offset >= 0) {
        PyObject *current = *(PyObject **)((char *)var + offset); /* borrowed; NULL if unset */
        if (current != expected || !PyDict_Check(current))
            return 0;
        return unmodified(current, tags, i) ? 1 : same_entries(current, entries);
    }
    PyObject *current = PyObject_GetAttr(var, metadata_name);
    if (current == NULL) {
        PyErr_Clear(); /* no metadata any more: not the flattening's Variable */
        return 0;
    }
    int same = current == expected && PyDict_Check(current) &&
               (unmodified(current, tags, i) || same_entries(current, entries));
    Py_DECREF(current);
    return same;
}

/* The fields of a guard state (built by treemode._tree._flatten._Guard), then,
 * where the interpreter has dict version tags, three tags. */
enum {
    ST_SIZED, ST_LENS, ST_DICTS, ST_VALUES, ST_ORDERED, ST_ITEMS, ST_METADATA,
    ST_METADATA_ENTRIES, ST_NODES, ST_NODE_TYPES, ST_OWNERS, ST_OWNER_DICTS,
    ST_VARIABLE_TYPES, ST_TOP_TYPE, ST_TOP_DICT, ST_FIELDS,
    ST_DICT_TAGS = ST_FIELDS, ST_ORDERED_TAGS, ST_METADATA_TAGS, ST_TAGGED_FIELDS
};
#define ST_TUPLES ST_TOP_TYPE /* the fields before it are tuples */

/* Whether the snapshot `state` (see `holds` below) still describes its
 * containers, the Variables in `variables` (a list or tuple) and the top-level
 * argument `top`: 1, 0, or -1 with an exception set. */
static int
state_holds(PyObject *state, PyObject *variables, PyObject *top)
{
    if (!configured())
        return -1;
    if (!PyTuple_Check(state) ||
        (PyTuple_GET_SIZE(state) != ST_FIELDS && PyTuple_GET_SIZE(state) != ST_TAGGED_FIELDS))
        return malformed("a guard state is a 15-tuple, or 18 with version tags");
    for (Py_ssize_t i = 0; i < ST_TUPLES; i++) {
        if (!PyTuple_Check(PyTuple_GET_ITEM(state, i)))
            return malformed("the first 13 items of a guard state are tuples");
    }
#define ST_LEN(i) PyTuple_GET_SIZE(PyTuple_GET_ITEM(state, (i)))
    if (ST_LEN(ST_SIZED) != ST_LEN(ST_LENS) || ST_LEN(ST_METADATA) != ST_LEN(ST_METADATA_ENTRIES) ||
        ST_LEN(ST_NODES) != ST_LEN(ST_NODE_TYPES) || ST_LEN(ST_OWNERS) != ST_LEN(ST_OWNER_DICTS) ||
        ST_LEN(ST_VARIABLE_TYPES) != ST_LEN(ST_METADATA))
        return malformed("a guard state has one length per sized container, one entries "
                         "tuple per metadata dict, one type per node and per Variable, and "
                         "one dict per owner");
#undef ST_LEN
    PyObject *sized = PyTuple_GET_ITEM(state, ST_SIZED);
    PyObject *lens = PyTuple_GET_ITEM(state, ST_LENS);
    PyObject *dicts = PyTuple_GET_ITEM(state, ST_DICTS);
    PyObject *values = PyTuple_GET_ITEM(state, ST_VALUES);
    PyObject *ordered = PyTuple_GET_ITEM(state, ST_ORDERED);
    PyObject *items = PyTuple_GET_ITEM(state, ST_ITEMS);
    PyObject *metadata = PyTuple_GET_ITEM(state, ST_METADATA);
    PyObject *metadata_entries = PyTuple_GET_ITEM(state, ST_METADATA_ENTRIES);
    PyObject *nodes = PyTuple_GET_ITEM(state, ST_NODES);
    PyObject *node_types = PyTuple_GET_ITEM(state, ST_NODE_TYPES);
    PyObject *owners = PyTuple_GET_ITEM(state, ST_OWNERS);
    PyObject *owner_dicts = PyTuple_GET_ITEM(state, ST_OWNER_DICTS);
    PyObject *variable_types = PyTuple_GET_ITEM(state, ST_VARIABLE_TYPES);
    PyObject *top_type = PyTuple_GET_ITEM(state, ST_TOP_TYPE);
    PyObject *top_dict = PyTuple_GET_ITEM(state, ST_TOP_DICT);
    int tagged = PyTuple_GET_SIZE(state) == ST_TAGGED_FIELDS;
    const uint64_t *dict_tags =
        tagged ? saved_tags(PyTuple_GET_ITEM(state, ST_DICT_TAGS), PyTuple_GET_SIZE(dicts)) : NULL;
    const uint64_t *ordered_tags =
        tagged ? saved_tags(PyTuple_GET_ITEM(state, ST_ORDERED_TAGS), PyTuple_GET_SIZE(ordered))
               : NULL;
    const uint64_t *metadata_tags =
        tagged ? saved_tags(PyTuple_GET_ITEM(state, ST_METADATA_TAGS), PyTuple_GET_SIZE(metadata))
               : NULL;
    Py_ssize_t k;
    int same;

    /* Types and __dict__ objects first (as _Guard.holds): the passes below read
     * the saved dicts. The top-level argument is not held by the state. */
    if (top_type != Py_None && (PyObject *)Py_TYPE(top) != top_type)
        return 0;
    if (top_dict != Py_None && (same = dict_is(top, top_dict)) != 1)
        return same;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(nodes); i++) {
        if ((PyObject *)Py_TYPE(PyTuple_GET_ITEM(nodes, i)) != PyTuple_GET_ITEM(node_types, i))
            return 0;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(owners); i++) {
        if ((same = dict_is(PyTuple_GET_ITEM(owners, i), PyTuple_GET_ITEM(owner_dicts, i))) != 1)
            return same;
    }
    Py_ssize_t n_vars = PySequence_Fast_GET_SIZE(variables);
    if (n_vars != PyTuple_GET_SIZE(variable_types))
        return 0;
    for (Py_ssize_t i = 0; i < n_vars; i++) {
        if ((PyObject *)Py_TYPE(PySequence_Fast_GET_ITEM(variables, i)) !=
            PyTuple_GET_ITEM(variable_types, i))
            return 0;
    }

    /* Lengths first: they keep the element-wise passes below aligned. */
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(sized); i++) {
        if ((same = same_length(PyTuple_GET_ITEM(sized, i), PyTuple_GET_ITEM(lens, i))) != 1)
            return same;
    }
    k = 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(dicts); i++) {
        PyObject *d = PyTuple_GET_ITEM(dicts, i);
        if (unmodified(d, dict_tags, i)) {
            k += PyDict_GET_SIZE(d); /* its length was checked above */
            continue;
        }
        if ((same = same_values(d, values, &k)) != 1)
            return same;
    }
    if (k != PyTuple_GET_SIZE(values))
        return 0;
    k = 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(ordered); i++) {
        PyObject *c = PyTuple_GET_ITEM(ordered, i);
        if (unmodified(c, ordered_tags, i)) {
            k += PyDict_GET_SIZE(c);
            continue;
        }
        if ((same = same_iteration(c, items, &k)) != 1)
            return same;
    }
    if (k != PyTuple_GET_SIZE(items))
        return 0;
    for (Py_ssize_t i = 0; i < n_vars; i++) {
        same = same_metadata(PySequence_Fast_GET_ITEM(variables, i), PyTuple_GET_ITEM(metadata, i),
                             PyTuple_GET_ITEM(metadata_entries, i), metadata_tags, i);
        if (same != 1)
            return same;
    }
    return 1;
}

PyDoc_STRVAR(holds_doc,
"holds(state, variables, top) -> bool\n\n"
"Whether the objects and Variables of a flattening snapshot are unchanged.\n\n"
"state: (sized, lens, dicts, values, ordered, items, metadata, metadata_entries,\n"
"nodes, node_types, owners, owner_dicts, variable_types, top_type, top_dict),\n"
"built by treemode._tree._flatten._Guard (then, where the interpreter has them, three\n"
"version tags): the dicts/lists whose lengths are checked and those lengths;\n"
"the dicts whose values are checked and all those values; the plain dicts/lists\n"
"whose iteration is checked and all those items; per Variable its metadata dict\n"
"and that dict's entries (k0, v0, k1, v1, ...); the objects whose type is\n"
"checked and those types; the objects whose __dict__ is checked and those\n"
"dicts; the Variables' types; the type and __dict__ of `top`, the top-level\n"
"argument (None: not checked). Every comparison is by identity.");

static PyObject *
holds(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "holds(state, variables, top) takes 3 arguments");
        return NULL;
    }
    PyObject *variables = PySequence_Fast(args[1], "variables must be a sequence");
    if (variables == NULL)
        return NULL;
    int ok = state_holds(args[0], variables, args[2]);
    Py_DECREF(variables);
    if (ok < 0)
        return NULL;
    return PyBool_FromLong(ok);
}

/* The object a weak reference points to (a new reference), or NULL (no
 * exception) once it is dead. */
static PyObject *
referent(PyObject *ref)
{
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *obj;
    if (PyWeakref_GetRef(ref, &obj) < 0)
        PyErr_Clear();
    return obj;
#else
    PyObject *obj = PyWeakref_GetObject(ref);
    if (obj == NULL) {
        PyErr_Clear();
        return NULL;
    }
    if (obj == Py_None)
        return NULL;
    Py_INCREF(obj);
    return obj;
#endif
}

/* References gathered while matching, in order: a buffer on the C stack that
 * becomes a tuple or a list once the count is known (no list regrowth, and the
 * arrays reach JAX without another copy). Holds new references. */
#define GATHERED_INLINE 32
typedef struct {
    PyObject **items;
    Py_ssize_t n, cap;
    PyObject *inline_items[GATHERED_INLINE];
} Gathered;

static void
gathered_init(Gathered *g)
{
    g->items = g->inline_items;
    g->n = 0;
    g->cap = GATHERED_INLINE;
}

static int
gathered_push(Gathered *g, PyObject *obj)
{
    if (g->n == g->cap) {
        Py_ssize_t cap = g->cap * 2;
        PyObject **items;
        if (g->items == g->inline_items) {
            items = PyMem_New(PyObject *, cap);
            if (items != NULL)
                memcpy(items, g->inline_items, g->n * sizeof(PyObject *));
        }
        else { /* (PyMem_Resize would overwrite g->items with NULL on failure) */
            items = (PyObject **)PyMem_Realloc(g->items, cap * sizeof(PyObject *));
        }
        if (items == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        g->items = items;
        g->cap = cap;
    }
    Py_INCREF(obj);
    g->items[g->n++] = obj;
    return 0;
}

static void
gathered_release(Gathered *g)
{
    Py_ssize_t n = g->n;
    g->n = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        Py_DECREF(g->items[i]);
    if (g->items != g->inline_items)
        PyMem_Free(g->items);
    gathered_init(g);
}

/* The gathered references as a new tuple (as_list 0) or list; empties `g`. */
static PyObject *
gathered_take(Gathered *g, int as_list)
{
    PyObject *out = as_list ? PyList_New(g->n) : PyTuple_New(g->n);
    if (out == NULL) {
        gathered_release(g);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < g->n; i++) {
        if (as_list)
            PyList_SET_ITEM(out, i, g->items[i]);
        else
            PyTuple_SET_ITEM(out, i, g->items[i]);
    }
    g->n = 0; /* the references moved into `out` */
    gathered_release(g);
    return out;
}

/* Gathers `var`'s `_raw_value`: 1, 0 if it has none, -1 on error. */
static int
gather_raw_value(Gathered *out, PyObject *var)
{
    Py_ssize_t offset = raw_value_offset(Py_TYPE(var));
    if (offset >= 0) {
        PyObject *value = *(PyObject **)((char *)var + offset); /* borrowed; NULL if unset */
        return value == NULL ? 0 : (gathered_push(out, value) < 0 ? -1 : 1);
    }
    PyObject *value = PyObject_GetAttr(var, raw_value_name);
    if (value == NULL) {
        PyErr_Clear();
        return 0;
    }
    int pushed = gathered_push(out, value);
    Py_DECREF(value);
    return pushed < 0 ? -1 : 1;
}

/* One argument of `match_into`: 1 matched (gathered), 0 not, -1 error. */
static int
match_one(PyObject *slot, PyObject *obj, Gathered *dynamic, Gathered *sources,
          PyObject *array_types, PyObject *slow)
{
    if (slot == Py_None) { /* a bare array */
        int known = PySet_Contains(array_types, (PyObject *)Py_TYPE(obj));
        if (known < 0)
            return -1;
        if (known)
            return gathered_push(dynamic, obj) < 0 ? -1 : 1;
    }
    PyObject *entry = NULL, *fast = NULL;
    int result = 0;
    if (slot != Py_None) {
        if (!PyWeakref_CheckRef(slot))
            return malformed("a call-site slot is None or a weak reference");
        entry = referent(slot);
        if (entry == NULL)
            return 0; /* the flattening was dropped */
        fast = slot_get(entry, fast_name, &fast_slots);
        if (fast == NULL)
            PyErr_Clear(); /* no fast state: decided in Python below */
    }
    if (fast != NULL && PyTuple_Check(fast) && PyTuple_GET_SIZE(fast) == 3) {
        /* (the argument's weak reference, the guard state, the Variables) */
        if (!PyWeakref_CheckRef(PyTuple_GET_ITEM(fast, 0)) ||
            !PyTuple_Check(PyTuple_GET_ITEM(fast, 2))) {
            result = malformed("a flattening's _fast is (weak reference, guard state, tuple)");
            goto done;
        }
        PyObject *arg = referent(PyTuple_GET_ITEM(fast, 0));
        Py_XDECREF(arg); /* only compared */
        if (arg != obj)
            goto done;
        PyObject *variables = PyTuple_GET_ITEM(fast, 2);
        result = state_holds(PyTuple_GET_ITEM(fast, 1), variables, obj);
        if (result != 1)
            goto done;
        /* Each value must still be one array (of a type in `array_types`): a value
         * that became a pytree, None or a number is decided in Python. */
        Py_ssize_t start = dynamic->n;
        int all_arrays = 1;
        PyTypeObject *seen_type = NULL; /* the last type found in `array_types` */
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(variables); i++) {
            result = gather_raw_value(dynamic, PyTuple_GET_ITEM(variables, i));
            if (result != 1)
                goto done;
            PyTypeObject *type = Py_TYPE(dynamic->items[dynamic->n - 1]);
            if (type == seen_type)
                continue;
            int known = PySet_Contains(array_types, (PyObject *)type);
            seen_type = known == 1 ? type : NULL;
            if (known < 0) {
                result = -1;
                goto done;
            }
            if (!known) { /* a Python number, or a value whose layout changed: Python decides */
                all_arrays = 0;
                break;
            }
        }
        if (all_arrays) {
            result = gathered_push(sources, entry) < 0 ? -1 : 1;
            goto done;
        }
        while (dynamic->n > start)
            Py_DECREF(dynamic->items[--dynamic->n]);
        result = 0;
    }
    /* Anything else is decided in Python: the new dynamic arrays, or None. */
    PyObject *found = PyObject_CallFunctionObjArgs(slow, entry ? entry : Py_None, obj, NULL);
    if (found == NULL) {
        result = -1;
    }
    else if (found == Py_None) {
        result = 0;
    }
    else {
        PyObject *items = PySequence_Fast(found, "the slow match returns a list or None");
        result = items == NULL ? -1 : 1;
        for (Py_ssize_t i = 0; result == 1 && i < PySequence_Fast_GET_SIZE(items); i++)
            result = gathered_push(dynamic, PySequence_Fast_GET_ITEM(items, i)) < 0 ? -1 : 1;
        Py_XDECREF(items);
        if (result == 1 && entry != NULL)
            result = gathered_push(sources, entry) < 0 ? -1 : 1;
    }
    Py_XDECREF(found);
done:
    Py_XDECREF(fast);
    Py_XDECREF(entry);
    if (result < 0 && !PyErr_Occurred())
        result = 0;
    return result;
}

/* Appends the gathered references to `list`, emptying `g`: 0, or -1. */
static int
gathered_extend(Gathered *g, PyObject *list)
{
    PyObject *items = gathered_take(g, 0);
    if (items == NULL)
        return -1;
    Py_ssize_t n = PyList_GET_SIZE(list);
    int result = PyList_SetSlice(list, n, n, items);
    Py_DECREF(items);
    return result;
}

PyDoc_STRVAR(match_into_doc,
"match_into(slots, objs, dynamic, sources, array_types, slow) -> bool\n\n"
"Whether every object of `objs` still matches its slot of a call-site memo\n"
"(treemode._pipeline._callsite); if so, appends their arrays to `dynamic` and the\n"
"matched flattenings to `sources`.\n\n"
"A slot is None (a bare array: its type must be in `array_types`) or a weak\n"
"reference to a cached flattening whose `_fast` attribute is (weak reference\n"
"to the argument, guard state, Variables): the argument must be that object,\n"
"the guard must hold, and each Variable's `_raw_value` is appended. Any other\n"
"case calls `slow(entry or None, obj)`, which returns the arrays or None.");

static PyObject *
match_into(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (!configured())
        return NULL;
    if (nargs != 6 || !PyTuple_Check(args[0]) || !PyList_Check(args[2]) ||
        !PyList_Check(args[3]) || !PyAnySet_Check(args[4]) || !PyCallable_Check(args[5])) {
        PyErr_SetString(PyExc_TypeError,
                        "match_into(slots: tuple, objs, dynamic: list, sources: list, "
                        "array_types: set, slow)");
        return NULL;
    }
    PyObject *slots = args[0];
    PyObject *objs = PySequence_Fast(args[1], "objs must be a sequence");
    if (objs == NULL)
        return NULL;
    Gathered dynamic, sources;
    gathered_init(&dynamic);
    gathered_init(&sources);
    int ok = PySequence_Fast_GET_SIZE(objs) == PyTuple_GET_SIZE(slots);
    for (Py_ssize_t i = 0; ok == 1 && i < PyTuple_GET_SIZE(slots); i++) {
        ok = match_one(PyTuple_GET_ITEM(slots, i), PySequence_Fast_GET_ITEM(objs, i), &dynamic,
                       &sources, args[4], args[5]);
    }
    Py_DECREF(objs);
    if (ok == 1 && (gathered_extend(&dynamic, args[2]) < 0 || gathered_extend(&sources, args[3]) < 0))
        ok = -1;
    gathered_release(&dynamic);
    gathered_release(&sources);
    if (ok < 0)
        return NULL;
    return PyBool_FromLong(ok);
}

/* The object a holder of the closure snapshot gives (a weak reference or a
 * strong holder, both called with no arguments): a new reference, or NULL
 * (no exception) if it is gone. */
static PyObject *
held(PyObject *holder)
{
    if (PyWeakref_CheckRef(holder))
        return referent(holder);
    PyObject *obj = PyObject_CallNoArgs(holder);
    if (obj == NULL) {
        PyErr_Clear();
        return NULL;
    }
    if (obj == Py_None) {
        Py_DECREF(obj);
        return NULL;
    }
    return obj;
}

/* Whether getattr(obj, name, None) is `expected`. */
static int
attribute_is(PyObject *obj, PyObject *name, PyObject *expected)
{
    PyObject *current = PyObject_GetAttr(obj, name);
    if (current == NULL) {
        PyErr_Clear();
        return expected == Py_None;
    }
    Py_DECREF(current); /* only compared; `expected` keeps the object alive */
    return current == expected;
}

/* Whether the cells of the function behind `holder` hold `contents`. */
static int
same_cells(PyObject *holder, PyObject *contents, PyObject *kinds, PyObject *ignore,
           PyObject *empty, PyObject *ignored)
{
    PyObject *f = held(holder);
    if (f == NULL)
        return 0;
    PyObject *cells = PyObject_GetAttr(f, closure_name);
    Py_DECREF(f); /* the cells tuple is held below */
    if (cells == NULL) {
        PyErr_Clear();
        return 0;
    }
    int same = PyTuple_Check(cells) && PyTuple_GET_SIZE(cells) == PyTuple_GET_SIZE(contents);
    for (Py_ssize_t i = 0; same == 1 && i < PyTuple_GET_SIZE(contents); i++) {
        PyObject *cell = PyTuple_GET_ITEM(cells, i);
        if (!PyCell_Check(cell)) {
            same = 0;
            break;
        }
        PyObject *current = PyCell_GET(cell); /* borrowed; NULL if empty */
        PyObject *expected = PyTuple_GET_ITEM(contents, i);
        if (expected == empty) {
            same = current == NULL;
        }
        else if (expected == ignored) {
            /* Still a value of an ignored type (not kept, so not compared). */
            if (current == NULL) {
                same = 0;
            }
            else {
                PyObject *kind = PyDict_GetItemWithError(kinds, (PyObject *)Py_TYPE(current));
                same = kind == NULL ? (PyErr_Occurred() ? -1 : 0)
                                    : PyObject_RichCompareBool(kind, ignore, Py_EQ);
            }
        }
        else {
            PyObject *obj = held(expected);
            same = obj != NULL && obj == current;
            Py_XDECREF(obj);
        }
    }
    Py_DECREF(cells);
    return same;
}

PyDoc_STRVAR(reads_hold_doc,
"reads_hold(reads, kinds, ignore, empty, ignored) -> bool\n\n"
"Whether every read behind a cached closure search (treemode._tree._closure) still\n"
"gives the same object. `reads` is (dicts, names, values, functions, codes,\n"
"cells, attrs): dicts[i].get(names[i]) must be values[i]; each function\n"
"holder's function must still have its code; each (function holder,\n"
"contents) pair's cells must hold `contents` (`empty`: an empty cell;\n"
"`ignored`: any value whose type `kinds` maps to `ignore`; else a holder of the\n"
"object); each (owner, name, value) must still be getattr(owner, name, None).");

/* What `reads_hold` answers: 1, 0, or -1 with an exception set. */
static int
closure_reads_hold(PyObject *reads, PyObject *kinds, PyObject *ignore, PyObject *empty,
                   PyObject *ignored)
{
    if (!PyTuple_Check(reads) || PyTuple_GET_SIZE(reads) != 7 || !PyDict_Check(kinds)) {
        PyErr_SetString(PyExc_TypeError,
                        "reads_hold(reads: 7-tuple, kinds: dict, ignore, empty, ignored)");
        return -1;
    }
    for (Py_ssize_t i = 0; i < 7; i++) {
        if (!PyTuple_Check(PyTuple_GET_ITEM(reads, i))) {
            PyErr_SetString(PyExc_TypeError, "reads_hold: every read group is a tuple");
            return -1;
        }
    }
    PyObject *dicts = PyTuple_GET_ITEM(reads, 0);
    PyObject *names = PyTuple_GET_ITEM(reads, 1);
    PyObject *values = PyTuple_GET_ITEM(reads, 2);
    PyObject *functions = PyTuple_GET_ITEM(reads, 3);
    PyObject *codes = PyTuple_GET_ITEM(reads, 4);
    PyObject *cells = PyTuple_GET_ITEM(reads, 5);
    PyObject *attrs = PyTuple_GET_ITEM(reads, 6);
    int ok = PyTuple_GET_SIZE(dicts) == PyTuple_GET_SIZE(names) &&
             PyTuple_GET_SIZE(names) == PyTuple_GET_SIZE(values) &&
             PyTuple_GET_SIZE(functions) == PyTuple_GET_SIZE(codes);
    for (Py_ssize_t i = 0; ok == 1 && i < PyTuple_GET_SIZE(names); i++) {
        PyObject *d = PyTuple_GET_ITEM(dicts, i);
        if (!PyDict_Check(d)) {
            ok = 0;
            break;
        }
        PyObject *current = PyDict_GetItemWithError(d, PyTuple_GET_ITEM(names, i));
        if (current == NULL) {
            if (PyErr_Occurred())
                return -1;
            current = Py_None;
        }
        ok = current == PyTuple_GET_ITEM(values, i);
    }
    for (Py_ssize_t i = 0; ok == 1 && i < PyTuple_GET_SIZE(functions); i++) {
        PyObject *f = held(PyTuple_GET_ITEM(functions, i));
        PyObject *code = PyTuple_GET_ITEM(codes, i);
        ok = f != NULL && (PyFunction_Check(f) ? PyFunction_GET_CODE(f) == code
                                               : attribute_is(f, code_name, code));
        Py_XDECREF(f);
    }
    for (Py_ssize_t i = 0; ok == 1 && i < PyTuple_GET_SIZE(cells); i++) {
        PyObject *pair = PyTuple_GET_ITEM(cells, i);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2 ||
            !PyTuple_Check(PyTuple_GET_ITEM(pair, 1))) {
            PyErr_SetString(PyExc_TypeError, "reads_hold: a cell read is (holder, contents)");
            return -1;
        }
        ok = same_cells(PyTuple_GET_ITEM(pair, 0), PyTuple_GET_ITEM(pair, 1), kinds, ignore,
                        empty, ignored);
    }
    for (Py_ssize_t i = 0; ok == 1 && i < PyTuple_GET_SIZE(attrs); i++) {
        PyObject *triple = PyTuple_GET_ITEM(attrs, i);
        if (!PyTuple_Check(triple) || PyTuple_GET_SIZE(triple) != 3) {
            PyErr_SetString(PyExc_TypeError, "reads_hold: an attribute read is (owner, name, value)");
            return -1;
        }
        ok = attribute_is(PyTuple_GET_ITEM(triple, 0), PyTuple_GET_ITEM(triple, 1),
                          PyTuple_GET_ITEM(triple, 2));
    }
    return ok;
}

static PyObject *
reads_hold(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "reads_hold takes 5 arguments");
        return NULL;
    }
    int ok = closure_reads_hold(args[0], args[1], args[2], args[3], args[4]);
    if (ok < 0)
        return NULL;
    return PyBool_FromLong(ok);
}

/* Sets `var._raw_value` to `value` (a new reference is taken) and appends
 * the previous value to `previous` (which keeps it alive until every write is
 * done). -1 with an exception on failure, with nothing written. */
static int
set_raw_value(PyObject *var, PyObject *value, PyObject *previous)
{
    Py_ssize_t offset = raw_value_offset(Py_TYPE(var));
    if (offset >= 0) {
        PyObject **slot = (PyObject **)((char *)var + offset);
        if (*slot == NULL) {
            PyErr_SetString(PyExc_AttributeError, "_raw_value");
            return -1;
        }
        if (PyList_Append(previous, *slot) < 0)
            return -1;
        PyObject *old = *slot;
        Py_INCREF(value);
        *slot = value;
        Py_DECREF(old); /* `previous` holds it */
        return 0;
    }
    PyObject *old = PyObject_GetAttr(var, raw_value_name);
    if (old == NULL)
        return -1;
    int appended = PyList_Append(previous, old);
    Py_DECREF(old);
    if (appended < 0)
        return -1;
    if (PyObject_GenericSetAttr(var, raw_value_name, value) < 0) {
        /* keep `previous` aligned with the writes made */
        PyList_SetSlice(previous, PyList_GET_SIZE(previous) - 1, PyList_GET_SIZE(previous), NULL);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(write_changed_doc,
"write_changed(variables, updates) -> int\n\n"
"Sets `variables[i]._raw_value = updates[i]` (as object.__setattr__ does) for\n"
"every update that is not None, all or nothing; returns how many were written.\n"
"The replaced values are released only after the last write.");

/* Writes every non-None `updates[i]` into `variables[i]` (both fast
 * sequences of one length), all or nothing: the count written, or -1. */
static Py_ssize_t
write_all(PyObject *variables, PyObject *updates)
{
    Py_ssize_t n = PySequence_Fast_GET_SIZE(variables);
    PyObject *previous = PyList_New(0); /* the replaced values, released last */
    if (previous == NULL)
        return -1;
    Py_ssize_t written = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *update = PySequence_Fast_GET_ITEM(updates, i);
        if (update == Py_None)
            continue;
        if (set_raw_value(PySequence_Fast_GET_ITEM(variables, i), update, previous) < 0) {
            /* Undo the writes made, newest first; the error stays the one raised. */
            PyObject *type, *value, *traceback;
            PyErr_Fetch(&type, &value, &traceback);
            Py_ssize_t k = PyList_GET_SIZE(previous);
            for (Py_ssize_t j = i - 1; j >= 0 && k > 0; j--) {
                if (PySequence_Fast_GET_ITEM(updates, j) == Py_None)
                    continue;
                k--;
                PyObject *var = PySequence_Fast_GET_ITEM(variables, j);
                PyObject *scratch = PyList_New(0);
                if (scratch == NULL || set_raw_value(var, PyList_GET_ITEM(previous, k), scratch) < 0)
                    PyErr_Clear();
                Py_XDECREF(scratch);
            }
            PyErr_Restore(type, value, traceback);
            written = -1;
            break;
        }
        written++;
    }
    Py_DECREF(previous);
    return written;
}

static PyObject *
write_changed(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (!configured())
        return NULL;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "write_changed(variables, updates) takes 2 arguments");
        return NULL;
    }
    PyObject *variables = PySequence_Fast(args[0], "variables must be a sequence");
    if (variables == NULL)
        return NULL;
    PyObject *updates = PySequence_Fast(args[1], "updates must be a sequence");
    if (updates == NULL) {
        Py_DECREF(variables);
        return NULL;
    }
    PyObject *result = NULL;
    if (PySequence_Fast_GET_SIZE(updates) != PySequence_Fast_GET_SIZE(variables)) {
        PyErr_SetString(PyExc_ValueError, "write_changed: one update per Variable");
    }
    else {
        Py_ssize_t written = write_all(variables, updates);
        if (written >= 0)
            result = PyLong_FromSsize_t(written);
    }
    Py_DECREF(updates);
    Py_DECREF(variables);
    return result;
}

/* ---- The call-site fast path: a memo-matched `treemode.jit` call in C ----
 *
 * `SiteCallFields` holds a matched call's fields (treemode._pipeline._callsite.SiteCall
 * adds the methods); `MemoCall` is the base of treemode.jit's JitWrapped: its
 * call runs the memo's plan (see `fast_call`) and otherwise, or when the plan
 * does not match, calls the Python method `_call`. */

typedef struct {
    PyObject_HEAD
    PyObject *site;
    PyObject *args;
    PyObject *kwargs;
    PyObject *dynamic;
    PyObject *sources;
    PyObject *full;
} SiteCallObject;

static PyTypeObject SiteCallFields_Type;

static PyObject *
site_call_new(PyTypeObject *type, PyObject *site, PyObject *args, PyObject *kwargs,
              PyObject *dynamic, PyObject *sources)
{
    SiteCallObject *call = (SiteCallObject *)type->tp_alloc(type, 0);
    if (call == NULL)
        return NULL;
    Py_INCREF(site);
    call->site = site;
    Py_INCREF(args);
    call->args = args;
    Py_INCREF(kwargs);
    call->kwargs = kwargs;
    Py_INCREF(dynamic);
    call->dynamic = dynamic;
    Py_INCREF(sources);
    call->sources = sources;
    call->full = NULL;
    return (PyObject *)call;
}

static PyObject *
site_call_tp_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *site, *call_args, *kwargs, *dynamic, *sources;
    static char *names[] = {"site", "args", "kwargs", "dynamic", "sources", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOO:SiteCall", names, &site, &call_args,
                                     &kwargs, &dynamic, &sources))
        return NULL;
    return site_call_new(type, site, call_args, kwargs, dynamic, sources);
}

static int
site_call_traverse(SiteCallObject *self, visitproc visit, void *arg)
{
    Py_VISIT(self->site);
    Py_VISIT(self->args);
    Py_VISIT(self->kwargs);
    Py_VISIT(self->dynamic);
    Py_VISIT(self->sources);
    Py_VISIT(self->full);
    return 0;
}

static int
site_call_clear(SiteCallObject *self)
{
    Py_CLEAR(self->site);
    Py_CLEAR(self->args);
    Py_CLEAR(self->kwargs);
    Py_CLEAR(self->dynamic);
    Py_CLEAR(self->sources);
    Py_CLEAR(self->full);
    return 0;
}

static void
site_call_dealloc(SiteCallObject *self)
{
    PyObject_GC_UnTrack(self);
    site_call_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef site_call_members[] = {
    {"site", T_OBJECT, offsetof(SiteCallObject, site), READONLY, "the CallSite matched"},
    {"args", T_OBJECT, offsetof(SiteCallObject, args), READONLY,
     "the positional arguments, bound ones first"},
    {"kwargs", T_OBJECT, offsetof(SiteCallObject, kwargs), READONLY, "the keyword arguments"},
    {"dynamic", T_OBJECT, offsetof(SiteCallObject, dynamic), READONLY,
     "the call's arrays, in the compiled function's order"},
    {"sources", T_OBJECT, offsetof(SiteCallObject, sources), READONLY,
     "the flattenings the Variables come from, in order"},
    {"_full", T_OBJECT, offsetof(SiteCallObject, full), 0, "the full Call, once built"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject SiteCallFields_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "treemode._accel._guard.SiteCallFields",
    .tp_doc = PyDoc_STR("SiteCallFields(site, args, kwargs, dynamic, sources): the fields "
                        "of a call matched to a call-site memo."),
    .tp_basicsize = sizeof(SiteCallObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = site_call_tp_new,
    .tp_traverse = (traverseproc)site_call_traverse,
    .tp_clear = (inquiry)site_call_clear,
    .tp_dealloc = (destructor)site_call_dealloc,
    .tp_members = site_call_members,
};

/* The objects a cached closure search still answers, matched against the
 * memo's `lifted_slots` (appending their arrays and flattenings): 1, 0, -1.
 *
 * `reads` and `found` are the snapshot's (see treemode._tree._closure._Snapshot).
 * Unlike the Python path, this does not ask whether the snapshot is still the
 * closure cache's entry for the function: every read the answer depends on is
 * checked, so an answer whose reads hold is right whether or not the cache
 * has since been cleared. */
static int
match_closure(PyObject *reads, PyObject *found, PyObject *lifted_slots, Gathered *dynamic,
              Gathered *sources)
{
    int ok = closure_reads_hold(reads, cfg_kinds, cfg_ignore, cfg_empty, cfg_ignored);
    if (ok != 1)
        return ok;
    /* found: [(name, holder), ...] */
    ok = PyList_Check(found) && PyList_GET_SIZE(found) == PyTuple_GET_SIZE(lifted_slots);
    for (Py_ssize_t i = 0; ok == 1 && i < PyTuple_GET_SIZE(lifted_slots); i++) {
        PyObject *pair = PyList_GET_ITEM(found, i);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            ok = 0;
            break;
        }
        PyObject *obj = held(PyTuple_GET_ITEM(pair, 1));
        if (obj == NULL) {
            ok = 0; /* the object died */
            break;
        }
        ok = match_one(PyTuple_GET_ITEM(lifted_slots, i), obj, dynamic, sources, cfg_array_types,
                       cfg_match_slow);
        Py_DECREF(obj);
    }
    return ok;
}

/* Binds `call` as the current call of a PureFunction's binding (a
 * threading.local: `binding.call = call`). */
static int
bind_call(PyObject *binding, PyObject *call)
{
    return PyObject_SetAttr(binding, call_name, call);
}

/* Runs `jitted(*arrays)` (the arrays, or the donated and the kept tuples) with
 * `call` bound, then unbinds; on failure, hands the error to
 * `raise_failure(call, error)` (which raises the better error). */
static PyObject *
run_bound(PyObject *jitted, PyObject *binding, PyObject *call, PyObject *const *arrays,
          Py_ssize_t n_arrays, PyObject *raise_failure)
{
    if (bind_call(binding, call) < 0)
        return NULL;
    PyObject *result = PyObject_Vectorcall(jitted, arrays, n_arrays, NULL);
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    if (bind_call(binding, Py_None) < 0) {
        if (type == NULL) { /* the unbinding failed alone: report it */
            Py_XDECREF(result);
            return NULL;
        }
        PyErr_Clear();
    }
    if (type == NULL)
        return result;
    PyErr_NormalizeException(&type, &value, &traceback);
    if (traceback != NULL)
        PyException_SetTraceback(value, traceback);
    PyObject *raised = PyObject_CallFunctionObjArgs(raise_failure, call, value, NULL);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(traceback);
    if (raised != NULL) {
        Py_DECREF(raised);
        PyErr_SetString(PyExc_SystemError, "treemode: the failure handler did not raise");
    }
    return NULL;
}

/* Donation: XLA cannot donate one buffer twice, nor a buffer also passed
 * undonated. `donation` = (donated indices, kept indices, check) splits the
 * call's arrays into the two tuples the entry takes; when two of them are the
 * same object, `check(call)` decides (it raises the error naming both paths, or
 * returns when the shared object is not a device buffer, like a Python int).
 * Fills split[0..1]: 0, or -1 with an exception. */
static int
compare_pointers(const void *a, const void *b)
{
    uintptr_t x = (uintptr_t)*(PyObject *const *)a, y = (uintptr_t)*(PyObject *const *)b;
    return x < y ? -1 : x > y;
}

static PyObject *
pick(PyObject *arrays, PyObject *indices)
{
    Py_ssize_t n = PyTuple_GET_SIZE(indices);
    PyObject *out = PyTuple_New(n);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t j = PyLong_AsSsize_t(PyTuple_GET_ITEM(indices, i));
        if (j < 0 || j >= PyTuple_GET_SIZE(arrays)) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_IndexError, "treemode: a donation index is out of range");
            Py_DECREF(out);
            return NULL;
        }
        PyObject *item = PyTuple_GET_ITEM(arrays, j);
        Py_INCREF(item);
        PyTuple_SET_ITEM(out, i, item);
    }
    return out;
}

/* Whether an object of `donated` appears twice, or also in `kept`: 1, 0, or -1. */
static int
shares_an_object(PyObject *donated, PyObject *kept)
{
    Py_ssize_t n = PyTuple_GET_SIZE(donated);
    PyObject **sorted = PyMem_New(PyObject *, n > 0 ? n : 1);
    if (sorted == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(sorted, &PyTuple_GET_ITEM(donated, 0), n * sizeof(PyObject *));
    qsort(sorted, n, sizeof(PyObject *), compare_pointers);
    int shared = 0;
    for (Py_ssize_t i = 1; !shared && i < n; i++)
        shared = sorted[i] == sorted[i - 1];
    for (Py_ssize_t i = 0; !shared && i < PyTuple_GET_SIZE(kept); i++) {
        PyObject *item = PyTuple_GET_ITEM(kept, i);
        shared = bsearch(&item, sorted, n, sizeof(PyObject *), compare_pointers) != NULL;
    }
    PyMem_Free(sorted);
    return shared;
}

static int
split_donated(PyObject *donation, PyObject *arrays, PyObject *call, PyObject **split)
{
    if (!PyTuple_Check(donation) || PyTuple_GET_SIZE(donation) != 3 ||
        !PyTuple_Check(PyTuple_GET_ITEM(donation, 0)) ||
        !PyTuple_Check(PyTuple_GET_ITEM(donation, 1))) {
        PyErr_SetString(PyExc_TypeError, "treemode: malformed donation plan");
        return -1;
    }
    split[0] = pick(arrays, PyTuple_GET_ITEM(donation, 0));
    split[1] = split[0] == NULL ? NULL : pick(arrays, PyTuple_GET_ITEM(donation, 1));
    int shared = split[1] == NULL ? -1 : shares_an_object(split[0], split[1]);
    if (shared == 1) {
        PyObject *checked = PyObject_CallOneArg(PyTuple_GET_ITEM(donation, 2), call);
        Py_XDECREF(checked);
        shared = checked == NULL ? -1 : 0;
    }
    if (shared < 0) {
        Py_CLEAR(split[0]);
        Py_CLEAR(split[1]);
        return -1;
    }
    return 0;
}

/* The write-back of a memo-matched call, in C when nothing needs Python, as
 * `write_back` in Python decides: no metadata update was traced (`record`),
 * the store hook is the default one, and every source flattening is
 * remembered as writable in the current trace. 1 written, 0 not attempted
 * (the caller writes in Python, which decides again), -1 error. */
static int
write_in_c(PyObject *record, PyObject *sources, PyObject *updates)
{
    if (!PyList_Check(sources) || !PyTuple_Check(updates))
        return 0;
    PyObject *metadata = PyObject_GetAttr(record, metadata_updates_name);
    if (metadata == NULL)
        return -1;
    int has_metadata = PyObject_IsTrue(metadata);
    Py_DECREF(metadata);
    if (has_metadata != 0)
        return has_metadata < 0 ? -1 : 0;
    PyObject *store = PyObject_GetAttr(cfg_store_owner, cfg_store_name);
    if (store == NULL)
        return -1;
    Py_DECREF(store); /* only compared; the owner holds it */
    if (store != cfg_default_store)
        return 0; /* replaced (tests inject faults there) */
    PyObject *ref = PyObject_GetAttr(current_trace, current_trace_attr);
    if (ref == NULL)
        return -1;
    PyObject *variables = PyList_New(0);
    if (variables == NULL) {
        Py_DECREF(ref);
        return -1;
    }
    int ok = ref != Py_None;
    for (Py_ssize_t i = 0; ok == 1 && i < PyList_GET_SIZE(sources); i++) {
        PyObject *source = PyList_GET_ITEM(sources, i);
        PyObject *writable_in = slot_get(source, writable_in_name, &writable_in_slots);
        if (writable_in == NULL) {
            ok = -1;
            break;
        }
        Py_DECREF(writable_in); /* only compared */
        if (writable_in != ref) {
            ok = 0;
            break;
        }
        PyObject *own = slot_get(source, variables_name, &variables_slots);
        if (own == NULL) {
            ok = -1;
            break;
        }
        if (!PyList_Check(own)) {
            ok = 0;
        }
        else {
            Py_ssize_t n = PyList_GET_SIZE(variables);
            ok = PyList_SetSlice(variables, n, n, own) < 0 ? -1 : 1;
        }
        Py_DECREF(own);
    }
    Py_DECREF(ref);
    if (ok == 1 && PyList_GET_SIZE(variables) != PyTuple_GET_SIZE(updates))
        ok = 0;
    if (ok == 1 && write_all(variables, updates) < 0)
        ok = -1;
    Py_DECREF(variables);
    return ok;
}

/* The signal hold of a donated call: treemode._pipeline._interrupts `hold`, `close` and
 * `release`, the functions the Python call path runs: `hold(donated)` before
 * the executable consumes the donated buffers; once the new values are written
 * (or the call failed), `close()` then `release(token)`.
 *
 * The common case runs here, on the module's own state, as the Python
 * functions would: the main thread, no hold open, nothing deferred, and the
 * handler table the same as when `hold` last planned its swaps (the
 * `_cache`); each handler is read with `_signal.getsignal`'s C function and
 * swapped with `_signal.signal`. Anything else calls the Python functions.
 * Imported on the first donated call. */
static PyObject *interrupts_module, *interrupts_hold, *interrupts_release;
static PyObject *interrupts_open, *interrupts_deferred, *interrupts_nested, *interrupts_signums;
static PyObject *interrupts_getsignal, *interrupts_setsignal, *interrupts_cache_name;
static unsigned long interrupts_main;

static int
interrupts_import(void)
{
    PyObject *module = PyImport_ImportModule("treemode._pipeline._interrupts");
    if (module == NULL)
        return -1;
    PyObject *objects[9] = {NULL};
    static const char *names[9] = {"hold", "release", "_open", "_deferred", "_NESTED",
                                   "_SIGNALS", "_getsignal", "_setsignal", "_MAIN_IDENT"};
    int ok = 1;
    for (int i = 0; i < 9 && ok; i++) {
        objects[i] = PyObject_GetAttrString(module, names[i]);
        ok = objects[i] != NULL;
    }
    unsigned long main_ident = ok ? PyLong_AsUnsignedLong(objects[8]) : 0;
    if (ok && PyErr_Occurred())
        ok = 0;
    if (ok && (!PyList_Check(objects[2]) || !PyList_Check(objects[3]) ||
               !PyTuple_Check(objects[5]))) {
        PyErr_SetString(PyExc_TypeError, "treemode: unexpected treemode._pipeline._interrupts layout");
        ok = 0;
    }
    if (ok && interrupts_cache_name == NULL) {
        interrupts_cache_name = PyUnicode_InternFromString("_cache");
        ok = interrupts_cache_name != NULL;
    }
    if (!ok) {
        for (int i = 0; i < 9; i++)
            Py_XDECREF(objects[i]);
        Py_DECREF(module);
        return -1;
    }
    interrupts_hold = objects[0];
    interrupts_release = objects[1];
    interrupts_open = objects[2];
    interrupts_deferred = objects[3];
    interrupts_nested = objects[4];
    interrupts_signums = objects[5];
    interrupts_getsignal = objects[6];
    interrupts_setsignal = objects[7];
    Py_DECREF(objects[8]);
    interrupts_main = main_ident;
    interrupts_module = module;
    return 0;
}

/* The planned swaps, a new reference, when the handler table is still the one
 * `_cache` planned them for; NULL without an exception when it changed. */
static PyObject *
interrupts_planned_swaps(void)
{
    PyObject *cache = PyObject_GetAttr(interrupts_module, interrupts_cache_name);
    if (cache == NULL)
        return NULL;
    PyObject *swaps = NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(interrupts_signums);
    if (PyTuple_Check(cache) && PyTuple_GET_SIZE(cache) == 2 &&
        PyTuple_Check(PyTuple_GET_ITEM(cache, 0)) && PyTuple_Check(PyTuple_GET_ITEM(cache, 1)) &&
        PyTuple_GET_SIZE(PyTuple_GET_ITEM(cache, 0)) == n) {
        PyObject *handlers = PyTuple_GET_ITEM(cache, 0);
        /* `_signal.getsignal` takes one argument (METH_O): its C function, called
         * directly; through the generic call otherwise. */
        int direct = PyCFunction_Check(interrupts_getsignal) &&
                     PyCFunction_GET_FLAGS(interrupts_getsignal) == METH_O;
        PyCFunction getsignal = direct ? PyCFunction_GET_FUNCTION(interrupts_getsignal) : NULL;
        PyObject *self = direct ? PyCFunction_GET_SELF(interrupts_getsignal) : NULL;
        Py_ssize_t i = 0;
        for (; i < n; i++) {
            PyObject *signum = PyTuple_GET_ITEM(interrupts_signums, i);
            PyObject *handler = direct ? getsignal(self, signum)
                                       : PyObject_CallOneArg(interrupts_getsignal, signum);
            if (handler == NULL)
                break;
            Py_DECREF(handler); /* only compared; the signal module holds it */
            if (handler != PyTuple_GET_ITEM(handlers, i))
                break;
        }
        if (i == n) {
            swaps = PyTuple_GET_ITEM(cache, 1);
            Py_INCREF(swaps);
        }
    }
    Py_DECREF(cache);
    return swaps;
}

static PyObject *
hold_signals(PyObject *donated)
{
    if (interrupts_module == NULL && interrupts_import() < 0)
        return NULL;
    if (PyThread_get_thread_ident() != interrupts_main)
        Py_RETURN_NONE;
    if (PyList_GET_SIZE(interrupts_open) != 0 || PyList_GET_SIZE(interrupts_deferred) != 0)
        return PyObject_CallOneArg(interrupts_hold, donated); /* nested, or leftovers */
    PyObject *swaps = interrupts_planned_swaps();
    if (swaps == NULL) {
        if (PyErr_Occurred())
            return NULL;
        return PyObject_CallOneArg(interrupts_hold, donated); /* plans again */
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(swaps); i++) {
        PyObject *swap = PyTuple_GET_ITEM(swaps, i); /* (signum, original, deferring) */
        PyObject *args[2] = {PyTuple_GET_ITEM(swap, 0), PyTuple_GET_ITEM(swap, 2)};
        PyObject *old = PyObject_Vectorcall(interrupts_setsignal, args, 2, NULL);
        if (old == NULL) { /* a pending signal's handler raised: nothing consumed yet */
            Py_DECREF(swaps);
            return NULL;
        }
        Py_DECREF(old);
    }
    if (PyList_Append(interrupts_open, donated) < 0) { /* open */
        Py_DECREF(swaps);
        return NULL;
    }
    return swaps;
}

/* `close()` then `release(token)`, in C where `hold_signals` held in C (no
 * signal deferred): the original handlers back. 0, or -1 with an exception. */
static int
close_and_release(PyObject *token)
{
    Py_ssize_t n = PyList_GET_SIZE(interrupts_open);
    if (n == 0) {
        PyErr_SetString(PyExc_SystemError, "treemode: a signal hold closed twice");
        return -1;
    }
    if (PyList_SetSlice(interrupts_open, n - 1, n, NULL) < 0) /* close */
        return -1;
    if (token == interrupts_nested)
        return 0;
    if (PyList_GET_SIZE(interrupts_deferred) != 0 || !PyTuple_Check(token)) {
        PyObject *released = PyObject_CallOneArg(interrupts_release, token);
        Py_XDECREF(released);
        return released == NULL ? -1 : 0;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(token); i++) {
        PyObject *swap = PyTuple_GET_ITEM(token, i); /* (signum, original, deferring) */
        PyObject *args[2] = {PyTuple_GET_ITEM(swap, 0), PyTuple_GET_ITEM(swap, 1)};
        PyObject *old = PyObject_Vectorcall(interrupts_setsignal, args, 2, NULL);
        if (old == NULL) /* a new signal's handler raised; the rest pass through */
            return -1;
        Py_DECREF(old);
    }
    return 0;
}

/* Ends the hold `token` (stolen; None: there was none). An exception already
 * set stays the one raised, unless the release raises (a held signal's
 * handler): that one is raised, with the first as its context. Returns -1
 * when an exception is set after. */
static int
release_signals(PyObject *token)
{
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    int released = token == Py_None ? 0 : close_and_release(token);
    Py_DECREF(token);
    if (released == 0) {
        PyErr_Restore(type, value, traceback);
        return type == NULL ? 0 : -1;
    }
    if (type != NULL) {
        PyErr_NormalizeException(&type, &value, &traceback);
        if (traceback != NULL)
            PyException_SetTraceback(value, traceback);
        PyObject *type2, *value2, *traceback2;
        PyErr_Fetch(&type2, &value2, &traceback2);
        PyErr_NormalizeException(&type2, &value2, &traceback2);
        PyException_SetContext(value2, value); /* steals `value` */
        value = NULL;
        PyErr_Restore(type2, value2, traceback2);
        Py_XDECREF(type);
        Py_XDECREF(traceback);
    }
    return -1;
}

/* A memo plan's records (treemode._accel._compiled.SitePlan, EntryPlan), checked once
 * when the memo is set (see `memo_set`); `fast_call` trusts their shape. */
enum { SITE_SITE, SITE_SLOTS, SITE_PARTIAL, SITE_READS, SITE_FOUND, SITE_LIFTED, SITE_FIELDS };
enum { ENTRY_JITTED, ENTRY_BINDING, ENTRY_ENTRY, ENTRY_RECORD, ENTRY_DONATION, ENTRY_FIELDS };

static int
plan_valid(PyObject *plan)
{
    if (plan == Py_None)
        return 1;
    if (!PyTuple_Check(plan) || PyTuple_GET_SIZE(plan) != 2)
        return malformed("a memo plan is (SitePlan, EntryPlan) or None");
    PyObject *site = PyTuple_GET_ITEM(plan, 0), *entry = PyTuple_GET_ITEM(plan, 1);
    if (!PyTuple_Check(site) || PyTuple_GET_SIZE(site) != SITE_FIELDS ||
        !PyTuple_Check(PyTuple_GET_ITEM(site, SITE_SLOTS)) ||
        !PyTuple_Check(PyTuple_GET_ITEM(site, SITE_PARTIAL)) ||
        !PyTuple_Check(PyTuple_GET_ITEM(site, SITE_READS)) ||
        !PyList_Check(PyTuple_GET_ITEM(site, SITE_FOUND)) ||
        !PyTuple_Check(PyTuple_GET_ITEM(site, SITE_LIFTED)))
        return malformed("a SitePlan is (site, slots: tuple, partial_args: tuple, "
                         "closure_reads: tuple, closure_found: list, lifted_slots: tuple)");
    if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != ENTRY_FIELDS)
        return malformed("an EntryPlan has 5 fields");
    PyObject *donation = PyTuple_GET_ITEM(entry, ENTRY_DONATION);
    if (!PyCallable_Check(PyTuple_GET_ITEM(entry, ENTRY_JITTED)) ||
        (donation != Py_None &&
         (!PyTuple_Check(donation) || PyTuple_GET_SIZE(donation) != 3 ||
          !PyTuple_Check(PyTuple_GET_ITEM(donation, 0)) ||
          !PyTuple_Check(PyTuple_GET_ITEM(donation, 1)) ||
          !PyCallable_Check(PyTuple_GET_ITEM(donation, 2)))))
        return malformed("an EntryPlan is (jitted: callable, binding, entry, record, donation: "
                         "None or (tuple, tuple, callable))");
    return 1;
}

/* A call through a memo's plan (see plan_valid): its result, or NULL with an
 * exception, or NULL without one when the arguments do not match the memo (the
 * caller then takes the Python path, which decides everything again). */
static PyObject *
fast_call(PyObject *plan, PyObject *args)
{
    PyObject *site_part = PyTuple_GET_ITEM(plan, 0);
    PyObject *entry_part = PyTuple_GET_ITEM(plan, 1);
    PyObject *site = PyTuple_GET_ITEM(site_part, SITE_SITE);
    PyObject *slots = PyTuple_GET_ITEM(site_part, SITE_SLOTS);
    PyObject *partial = PyTuple_GET_ITEM(site_part, SITE_PARTIAL);
    PyObject *reads = PyTuple_GET_ITEM(site_part, SITE_READS);
    PyObject *found = PyTuple_GET_ITEM(site_part, SITE_FOUND);
    PyObject *lifted_slots = PyTuple_GET_ITEM(site_part, SITE_LIFTED);
    PyObject *jitted = PyTuple_GET_ITEM(entry_part, ENTRY_JITTED);
    PyObject *binding = PyTuple_GET_ITEM(entry_part, ENTRY_BINDING);
    PyObject *entry = PyTuple_GET_ITEM(entry_part, ENTRY_ENTRY);
    PyObject *record = PyTuple_GET_ITEM(entry_part, ENTRY_RECORD);
    PyObject *donation = PyTuple_GET_ITEM(entry_part, ENTRY_DONATION);

    PyObject *roots = NULL, *dynamic = NULL, *sources = NULL, *kwargs = NULL, *call = NULL;
    PyObject *result = NULL, *out = NULL, *split[2] = {NULL, NULL}, *held = NULL;
    Gathered gathered_dynamic, gathered_sources;
    gathered_init(&gathered_dynamic);
    gathered_init(&gathered_sources);
    int ok = 0;
    if (PyTuple_GET_SIZE(partial) == 0) {
        Py_INCREF(args);
        roots = args;
    }
    else {
        roots = PySequence_Concat(partial, args);
        if (roots == NULL)
            goto done;
    }
    if (PyTuple_GET_SIZE(roots) != PyTuple_GET_SIZE(slots))
        goto done; /* a miss */
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(slots); i++) {
        ok = match_one(PyTuple_GET_ITEM(slots, i), PyTuple_GET_ITEM(roots, i), &gathered_dynamic,
                       &gathered_sources, cfg_array_types, cfg_match_slow);
        if (ok != 1)
            goto done;
    }
    ok = match_closure(reads, found, lifted_slots, &gathered_dynamic, &gathered_sources);
    if (ok != 1)
        goto done;
    ok = -1; /* from here on, every failure is an error */
    dynamic = gathered_take(&gathered_dynamic, 0);
    sources = gathered_take(&gathered_sources, 1);
    if (dynamic == NULL || sources == NULL)
        goto done;
    kwargs = PyDict_New();
    if (kwargs == NULL)
        goto done;
    call = site_call_new(cfg_site_call, site, roots, kwargs, dynamic, sources);
    if (call == NULL)
        goto done;
    if (donation == Py_None) { /* the arrays as positional arguments */
        result = run_bound(jitted, binding, call, &PyTuple_GET_ITEM(dynamic, 0),
                           PyTuple_GET_SIZE(dynamic), cfg_raise_failure);
    }
    else {
        if (split_donated(donation, dynamic, call, split) < 0)
            goto done;
        /* From here to the end of the write, a signal's handler that raises would
         * leave deleted buffers once the executable ran: held (see hold_signals). */
        held = hold_signals(split[0]);
        if (held == NULL)
            goto done;
        result = run_bound(jitted, binding, call, split, 2, cfg_raise_failure);
    }
    if (result == NULL)
        goto done;
    if (!PyTuple_Check(result) || PyTuple_GET_SIZE(result) != 2) {
        PyErr_SetString(PyExc_TypeError, "treemode: a compiled entry returns (out, updates)");
        goto done;
    }
    /* A trace without updates returns (out, None): nothing to write. */
    PyObject *updates = PyTuple_GET_ITEM(result, 1);
    if (updates != Py_None) {
        int in_c = write_in_c(record, sources, updates);
        if (in_c < 0)
            goto done;
        if (in_c == 0) {
            PyObject *written =
                PyObject_CallMethodObjArgs(entry, write_back_name, call, updates, NULL);
            if (written == NULL)
                goto done;
            Py_DECREF(written);
        }
    }
    out = PyTuple_GET_ITEM(result, 0);
    Py_INCREF(out);
done:
    if (ok < 0 && out == NULL && !PyErr_Occurred())
        PyErr_SetString(PyExc_SystemError, "treemode: the memo call failed without an error");
    if (held != NULL && release_signals(held) < 0)
        Py_CLEAR(out); /* a deferred signal's exception, raised after the write */
    Py_XDECREF(result);
    Py_XDECREF(split[0]);
    Py_XDECREF(split[1]);
    Py_XDECREF(call);
    Py_XDECREF(kwargs);
    Py_XDECREF(sources);
    Py_XDECREF(dynamic);
    Py_XDECREF(roots);
    gathered_release(&gathered_dynamic);
    gathered_release(&gathered_sources);
    return out;
}

typedef struct {
    PyObject_HEAD
    PyObject *memo;
} MemoCallObject;

static PyObject *
memo_call(PyObject *self, PyObject *args, PyObject *kwargs)
{
    PyObject *memo = ((MemoCallObject *)self)->memo;
    /* `memo_set` checked its shape: None, or (site, entry, plan or None). */
    if (memo != NULL && memo != Py_None && PyTuple_GET_ITEM(memo, 2) != Py_None &&
        config_call_path != NULL && (kwargs == NULL || PyDict_GET_SIZE(kwargs) == 0)) {
        Py_INCREF(memo); /* another thread may replace it meanwhile */
        PyObject *result = fast_call(PyTuple_GET_ITEM(memo, 2), args);
        Py_DECREF(memo);
        if (result != NULL || PyErr_Occurred())
            return result;
    }
    PyObject *slow_path = PyObject_GetAttr(self, slow_call_name);
    if (slow_path == NULL)
        return NULL;
    PyObject *result = PyObject_Call(slow_path, args, kwargs);
    Py_DECREF(slow_path);
    return result;
}

static PyObject *
memo_get(MemoCallObject *self, void *Py_UNUSED(closure))
{
    PyObject *memo = self->memo == NULL ? Py_None : self->memo;
    Py_INCREF(memo);
    return memo;
}

static int
memo_set(MemoCallObject *self, PyObject *memo, void *Py_UNUSED(closure))
{
    if (memo == NULL)
        memo = Py_None;
    if (memo != Py_None &&
        (!PyTuple_Check(memo) || PyTuple_GET_SIZE(memo) != 3 || plan_valid(PyTuple_GET_ITEM(memo, 2)) < 0)) {
        if (!PyErr_Occurred())
            malformed("a memo is None or (CallSite, compiled entry, MemoPlan or None)");
        return -1;
    }
    Py_INCREF(memo);
    Py_XSETREF(self->memo, memo);
    return 0;
}

static int
memo_call_traverse(MemoCallObject *self, visitproc visit, void *arg)
{
    Py_VISIT(self->memo);
    return 0;
}

static int
memo_call_clear(MemoCallObject *self)
{
    Py_CLEAR(self->memo);
    return 0;
}

static void
memo_call_dealloc(MemoCallObject *self)
{
    PyObject_GC_UnTrack(self);
    memo_call_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyGetSetDef memo_call_getset[] = {
    {"_memo", (getter)memo_get, (setter)memo_set,
     PyDoc_STR("None, or (CallSite, compiled entry, MemoPlan or None) of the last call"), NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject MemoCall_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "treemode._accel._guard.MemoCall",
    .tp_doc = PyDoc_STR("Base of a callable whose calls first try its call-site memo's plan "
                        "in C, then its `_call` method."),
    .tp_basicsize = sizeof(MemoCallObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_call = memo_call,
    .tp_traverse = (traverseproc)memo_call_traverse,
    .tp_clear = (inquiry)memo_call_clear,
    .tp_dealloc = (destructor)memo_call_dealloc,
    .tp_getset = memo_call_getset,
};

/* configure(layout, call_path): see treemode._accel._compiled.Layout and CallPath. */
enum { LAYOUT_RAW_VALUE, LAYOUT_METADATA, LAYOUT_TRACE, LAYOUT_TRACE_ATTR, LAYOUT_FIELDS };
enum {
    CP_ARRAY_TYPES, CP_MATCH_SLOW, CP_KINDS, CP_IGNORE, CP_EMPTY, CP_IGNORED, CP_SITE_CALL,
    CP_RAISE_FAILURE, CP_STORE_OWNER, CP_STORE_NAME, CP_DEFAULT_STORE, CP_FIELDS
};

static int
object_slot_member(PyObject *descr)
{
    return Py_IS_TYPE(descr, &PyMemberDescr_Type) &&
           ((PyMemberDescrObject *)descr)->d_member->type == T_OBJECT_EX &&
           !(((PyMemberDescrObject *)descr)->d_member->flags & READONLY);
}

PyDoc_STRVAR(configure_doc,
"configure(layout, call_path) -> None\n\n"
"Set what the C code reads and calls (treemode._accel._compiled.configure calls it\n"
"once). layout: (raw_value, var_metadata, current_trace, current_trace_attr):\n"
"the Variable slots' member descriptors, and an object whose attribute\n"
"`current_trace_attr` is the current trace's weak reference. call_path:\n"
"(array_types: set, match_slow, closure_kinds: dict, closure_ignore,\n"
"closure_empty, closure_ignored, site_call: a SiteCallFields subclass,\n"
"raise_failure, store_owner, store_name: str, default_store).");

static PyObject *
configure(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "configure(layout, call_path) takes 2 arguments");
        return NULL;
    }
    PyObject *layout = args[0], *path = args[1];
    if (!PyTuple_Check(layout) || PyTuple_GET_SIZE(layout) != LAYOUT_FIELDS ||
        !object_slot_member(PyTuple_GET_ITEM(layout, LAYOUT_RAW_VALUE)) ||
        !object_slot_member(PyTuple_GET_ITEM(layout, LAYOUT_METADATA)) ||
        !PyUnicode_Check(PyTuple_GET_ITEM(layout, LAYOUT_TRACE_ATTR))) {
        malformed("configure: layout is (raw_value, var_metadata: object-slot member "
                  "descriptors, current_trace, current_trace_attr: str)");
        return NULL;
    }
    if (!PyTuple_Check(path) || PyTuple_GET_SIZE(path) != CP_FIELDS ||
        !PyAnySet_Check(PyTuple_GET_ITEM(path, CP_ARRAY_TYPES)) ||
        !PyCallable_Check(PyTuple_GET_ITEM(path, CP_MATCH_SLOW)) ||
        !PyDict_Check(PyTuple_GET_ITEM(path, CP_KINDS)) ||
        !PyType_Check(PyTuple_GET_ITEM(path, CP_SITE_CALL)) ||
        !PyType_IsSubtype((PyTypeObject *)PyTuple_GET_ITEM(path, CP_SITE_CALL),
                          &SiteCallFields_Type) ||
        !PyCallable_Check(PyTuple_GET_ITEM(path, CP_RAISE_FAILURE)) ||
        !PyUnicode_Check(PyTuple_GET_ITEM(path, CP_STORE_NAME)) ||
        !PyCallable_Check(PyTuple_GET_ITEM(path, CP_DEFAULT_STORE))) {
        malformed("configure: call_path is (array_types: set, match_slow: callable, "
                  "closure_kinds: dict, closure_ignore, closure_empty, closure_ignored, "
                  "site_call: SiteCallFields subclass, raise_failure: callable, store_owner, "
                  "store_name: str, default_store: callable)");
        return NULL;
    }
    Py_INCREF(layout);
    Py_XSETREF(config_layout, layout);
    Py_INCREF(path);
    Py_XSETREF(config_call_path, path);
    raw_value_member = PyTuple_GET_ITEM(layout, LAYOUT_RAW_VALUE);
    metadata_member = PyTuple_GET_ITEM(layout, LAYOUT_METADATA);
    raw_value_name = PyDescr_NAME(raw_value_member);
    metadata_name = PyDescr_NAME(metadata_member);
    current_trace = PyTuple_GET_ITEM(layout, LAYOUT_TRACE);
    current_trace_attr = PyTuple_GET_ITEM(layout, LAYOUT_TRACE_ATTR);
    cfg_array_types = PyTuple_GET_ITEM(path, CP_ARRAY_TYPES);
    cfg_match_slow = PyTuple_GET_ITEM(path, CP_MATCH_SLOW);
    cfg_kinds = PyTuple_GET_ITEM(path, CP_KINDS);
    cfg_ignore = PyTuple_GET_ITEM(path, CP_IGNORE);
    cfg_empty = PyTuple_GET_ITEM(path, CP_EMPTY);
    cfg_ignored = PyTuple_GET_ITEM(path, CP_IGNORED);
    cfg_site_call = (PyTypeObject *)PyTuple_GET_ITEM(path, CP_SITE_CALL);
    cfg_raise_failure = PyTuple_GET_ITEM(path, CP_RAISE_FAILURE);
    cfg_store_owner = PyTuple_GET_ITEM(path, CP_STORE_OWNER);
    cfg_store_name = PyTuple_GET_ITEM(path, CP_STORE_NAME);
    cfg_default_store = PyTuple_GET_ITEM(path, CP_DEFAULT_STORE);
    /* The Variable slots may be other descriptors now. */
    slot_cache_clear(&raw_value_slots);
    slot_cache_clear(&metadata_slots);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"configure", (PyCFunction)(void (*)(void))configure, METH_FASTCALL, configure_doc},
    {"holds", (PyCFunction)(void (*)(void))holds, METH_FASTCALL, holds_doc},
    {"version_tags", (PyCFunction)version_tags, METH_O, version_tags_doc},
    {"match_into", (PyCFunction)(void (*)(void))match_into, METH_FASTCALL, match_into_doc},
    {"reads_hold", (PyCFunction)(void (*)(void))reads_hold, METH_FASTCALL, reads_hold_doc},
    {"write_changed", (PyCFunction)(void (*)(void))write_changed, METH_FASTCALL,
     write_changed_doc},
    {NULL, NULL, 0, NULL},
};

static int
add_type(PyObject *module, const char *name, PyTypeObject *type)
{
    if (PyType_Ready(type) < 0)
        return -1;
    Py_INCREF(type);
    if (PyModule_AddObject(module, name, (PyObject *)type) < 0) {
        Py_DECREF(type);
        return -1;
    }
    return 0;
}

static PyObject *
intern_once(PyObject **slot, const char *text)
{
    if (*slot == NULL)
        *slot = PyUnicode_InternFromString(text);
    return *slot;
}

/* Multi-phase initialization (PEP 489). The configuration and the slot caches
 * are process-wide statics, so the module declares itself unfit for
 * subinterpreters with their own GIL, and needs the GIL (3.13+). */
static int
module_exec(PyObject *module)
{
    if (intern_once(&fast_name, "_fast") == NULL || intern_once(&code_name, "__code__") == NULL ||
        intern_once(&closure_name, "__closure__") == NULL ||
        intern_once(&call_name, "call") == NULL ||
        intern_once(&write_back_name, "write_back") == NULL ||
        intern_once(&slow_call_name, "_call") == NULL ||
        intern_once(&metadata_updates_name, "metadata_updates") == NULL ||
        intern_once(&writable_in_name, "writable_in") == NULL ||
        intern_once(&variables_name, "variables") == NULL ||
        intern_once(&dict_name, "__dict__") == NULL ||
        intern_once(&getattribute_name, "__getattribute__") == NULL || init_dict_access() < 0)
        return -1;
    if (add_type(module, "SiteCallFields", &SiteCallFields_Type) < 0 ||
        add_type(module, "MemoCall", &MemoCall_Type) < 0)
        return -1;
    return 0;
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
#ifdef Py_mod_multiple_interpreters
    {Py_mod_multiple_interpreters, Py_MOD_MULTIPLE_INTERPRETERS_NOT_SUPPORTED},
#endif
#ifdef Py_mod_gil
    {Py_mod_gil, Py_MOD_GIL_USED},
#endif
    {0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "treemode._accel._guard",
    .m_doc = "treemode's optional compiled call path (see treemode/_accel/_compiled.py).",
    .m_size = 0,
    .m_methods = methods,
    .m_slots = module_slots,
};

PyMODINIT_FUNC
PyInit__guard(void)
{
    return PyModuleDef_Init(&module_def);
}
