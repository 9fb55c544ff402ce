/* treemode's optional compiled extension (imported only by treemode/_accel/_compiled.py).
 *
 * Kernels, each with a Python twin bound to it by tests/test_twins.py (the
 * flattening guard `holds`/`version_tags`, the closure-read check
 * `reads_hold`, the bulk write `write_changed`), and the executor of the
 * fast-path record the Python pipeline emits (`FastRecord`, run by `FastCall`;
 * every doubt goes back to Python through one callback, the miss). Nothing here
 * reads a private Flax or JAX name, nor an attribute of treemode's objects by
 * name: `configure` hands over, once and by keyword, what treemode/_compat.py
 * verified and the signal hold's objects; the record and the cached flattenings
 * (`Guarded`) are C structures. docs/contributing.md describes both kinds.
 *
 * The guard: a cached flattening stays valid while every container it walked
 * through still holds the very same objects; `holds` compares the snapshot
 * `_Guard` (treemode/_tree/_flatten.py) saved with the current contents by
 * pointer, calling no Python code but one attribute read per Variable. The
 * snapshot keeps every saved object alive, so equal pointers mean the same object.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <signal.h>       /* raise: delivering held signals */
#include <structmember.h> /* T_OBJECT_EX */

static PyObject *code_name;      /* interned "__code__" */
static PyObject *closure_name;   /* interned "__closure__" */
static PyObject *dict_name;      /* interned "__dict__" */

/* The configuration (see `configure`), held. */
static int is_configured;
static PyObject *raw_value_member;   /* Variable._raw_value's member descriptor */
static PyObject *metadata_member;    /* Variable._var_metadata's member descriptor */
static PyObject *raw_value_name, *metadata_name; /* their names (borrowed from them) */
static PyObject *trace_state;        /* its attribute `trace_attr`: the current trace's weakref */
static PyObject *trace_attr;
static PyObject *cfg_array_types, *cfg_kinds, *cfg_ignore, *cfg_empty, *cfg_ignored;
static PyObject *hold_open, *hold_deferred, *hold_plan, *hold_signals_tuple, *hold_getsignal,
    *hold_setsignal;
static unsigned long hold_main_thread;
static PyObject *debug_checks; /* JAX's jax_debug_nans/infs states: a donated call misses under one */
static PyObject *value_name;   /* "value", the attribute of those states read */

/* 0 (with a RuntimeError) until `configure` was called. */
static int
configured(void)
{
    if (is_configured)
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

static SlotCache metadata_slots, raw_value_slots;

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

/* Whether `obj.__dict__` is `expected`: 1, 0, or -1 with the exception raised. */
static int
dict_is(PyObject *obj, PyObject *expected)
{
    PyObject *current = PyObject_GetAttr(obj, dict_name);
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
/* Their names, in that order: treemode/_tree/_flatten.py builds a state by them. */
static char *guard_state_fields[] = {
    "sized", "lens", "dicts", "values", "ordered", "items", "metadata", "metadata_entries",
    "nodes", "node_types", "owners", "owner_dicts", "variable_types", "top_type", "top_dict",
    "dict_tags", "ordered_tags", "metadata_tags", NULL,
};

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
"Whether the objects and Variables of a flattening snapshot are unchanged (the\n"
"state's fields: GUARD_STATE_FIELDS, built by treemode._tree._flatten._Guard).");

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

/* Appends `var`'s `_raw_value` to `out`: 1, 0 if it has none, -1 on error. */
static int
gather_raw_value(PyObject *out, PyObject *var)
{
    Py_ssize_t offset = raw_value_offset(Py_TYPE(var));
    if (offset >= 0) {
        PyObject *value = *(PyObject **)((char *)var + offset); /* borrowed; NULL if unset */
        return value == NULL ? 0 : (PyList_Append(out, value) < 0 ? -1 : 1);
    }
    PyObject *value = PyObject_GetAttr(var, raw_value_name);
    if (value == NULL) {
        PyErr_Clear();
        return 0;
    }
    int appended = PyList_Append(out, value);
    Py_DECREF(value);
    return appended < 0 ? -1 : 1;
}

/* ---- Guarded: a cached flattening, as the executor reads it ----
 *
 * treemode/_tree/_flatten.py makes one for each cache entry whose dynamic
 * arrays are exactly its Variables' values and whose guard is compiled: the
 * argument (a weak reference), the guard state (see `holds`), the Variables
 * (a tuple) and the cache entry itself (a weak reference). The entry holds it;
 * a call-site slot is a weak reference to it, so a slot dies with the entry. */
typedef struct {
    PyObject_HEAD
    PyObject *arg, *state, *variables, *flat;
    PyObject *weakreflist;
} GuardedObject;

static PyTypeObject Guarded_Type;

static PyObject *
guarded_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"arg", "state", "variables", "flat", NULL};
    PyObject *arg, *state, *variables, *flat;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO!O!O:Guarded", names, &arg, &PyTuple_Type,
                                     &state, &PyTuple_Type, &variables, &flat))
        return NULL;
    if (!PyWeakref_CheckRef(arg) || !PyWeakref_CheckRef(flat)) {
        PyErr_SetString(PyExc_TypeError, "Guarded: arg and flat are weak references");
        return NULL;
    }
    GuardedObject *self = (GuardedObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->arg = Py_NewRef(arg);
    self->state = Py_NewRef(state);
    self->variables = Py_NewRef(variables);
    self->flat = Py_NewRef(flat);
    return (PyObject *)self;
}

/* The C types here (`Guarded`, `FastRecord`, `FastCall`) keep their objects in
 * consecutive fields: one traverse and one clear serve them all. */
static int
fields_traverse(PyObject **fields, int n, visitproc visit, void *arg)
{
    for (int i = 0; i < n; i++)
        Py_VISIT(fields[i]);
    return 0;
}

static int
fields_clear(PyObject **fields, int n)
{
    for (int i = 0; i < n; i++)
        Py_CLEAR(fields[i]);
    return 0;
}

#define GUARDED_OBJECTS 4 /* arg, state, variables, flat */

static int
guarded_traverse(GuardedObject *self, visitproc visit, void *arg)
{
    return fields_traverse(&self->arg, GUARDED_OBJECTS, visit, arg);
}

static int
guarded_clear(GuardedObject *self)
{
    return fields_clear(&self->arg, GUARDED_OBJECTS);
}

static void
guarded_dealloc(GuardedObject *self)
{
    PyObject_GC_UnTrack(self);
    if (self->weakreflist != NULL)
        PyObject_ClearWeakRefs((PyObject *)self);
    guarded_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef guarded_members[] = {
    {"arg", T_OBJECT, offsetof(GuardedObject, arg), READONLY, "weak reference to the argument"},
    {"state", T_OBJECT, offsetof(GuardedObject, state), READONLY, "the compiled guard state"},
    {"variables", T_OBJECT, offsetof(GuardedObject, variables), READONLY, "the Variables"},
    {"flat", T_OBJECT, offsetof(GuardedObject, flat), READONLY,
     "weak reference to the cache entry"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject Guarded_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "treemode._accel._guard.Guarded",
    .tp_doc = PyDoc_STR("Guarded(arg, state, variables, flat): a cached flattening as the "
                        "executor reads it."),
    .tp_basicsize = sizeof(GuardedObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = guarded_new,
    .tp_traverse = (traverseproc)guarded_traverse,
    .tp_clear = (inquiry)guarded_clear,
    .tp_dealloc = (destructor)guarded_dealloc,
    .tp_members = guarded_members,
    .tp_weaklistoffset = offsetof(GuardedObject, weakreflist),
};

/* Whether `obj`, passed where the memo saw a bare array, is one (`jax.jit`'s
 * rule: an array of a known type, or a Python number): 1, 0, or -1. */
static int
bare_array(PyObject *obj)
{
    if (PyFloat_CheckExact(obj) || PyLong_CheckExact(obj) || PyBool_Check(obj) ||
        PyComplex_CheckExact(obj))
        return 1;
    return PySet_Contains(cfg_array_types, (PyObject *)Py_TYPE(obj));
}

/* A Guarded against the object passed: 1 matched (its Variables' values
 * appended to `dynamic`, the Variables to `variables`), 0 not (also where a
 * value is no longer an array of a known type: a Python number, or a layout
 * change), -1 error. */
static int
match_guarded(GuardedObject *g, PyObject *obj, PyObject *dynamic, PyObject *variables)
{
    PyObject *arg = referent(g->arg);
    Py_XDECREF(arg); /* only compared */
    if (arg != obj)
        return 0;
    int result = state_holds(g->state, g->variables, obj);
    if (result != 1)
        return result;
    Py_ssize_t n = PyTuple_GET_SIZE(g->variables);
    PyTypeObject *seen_type = NULL; /* the last type found in `cfg_array_types` */
    for (Py_ssize_t i = 0; i < n; i++) {
        result = gather_raw_value(dynamic, PyTuple_GET_ITEM(g->variables, i));
        if (result != 1)
            return result;
        PyTypeObject *type = Py_TYPE(PyList_GET_ITEM(dynamic, PyList_GET_SIZE(dynamic) - 1));
        if (type == seen_type)
            continue;
        int known = PySet_Contains(cfg_array_types, (PyObject *)type);
        if (known != 1)
            return known;
        seen_type = type;
    }
    Py_ssize_t end = PyList_GET_SIZE(variables);
    return PyList_SetSlice(variables, end, end, g->variables) < 0 ? -1 : 1;
}

/* One object against its record slot: 1 matched (its arrays appended to
 * `dynamic`, its Variables to `variables`), 0 not (a miss), -1 error. A slot is
 * None (a bare array) or a weak reference to a `Guarded`; a value that is no
 * longer an array of a known type is a miss too. */
static int
match_one(PyObject *slot, PyObject *obj, PyObject *dynamic, PyObject *variables)
{
    if (slot == Py_None) {
        int known = bare_array(obj);
        return known != 1 ? known : (PyList_Append(dynamic, obj) < 0 ? -1 : 1);
    }
    PyObject *held_obj = referent(slot); /* the record checked: a weak reference */
    if (held_obj == NULL)
        return 0; /* the flattening was dropped */
    int result = Py_IS_TYPE(held_obj, &Guarded_Type)
                     ? match_guarded((GuardedObject *)held_obj, obj, dynamic, variables)
                     : 0;
    Py_DECREF(held_obj);
    return result;
}

/* The object a holder of the closure snapshot gives (a weak reference, or a
 * 1-tuple for an object that cannot be weakly referenced): a new reference,
 * or NULL (no exception) if it is gone or the holder is neither. */
static PyObject *
held(PyObject *holder)
{
    if (PyWeakref_CheckRef(holder))
        return referent(holder);
    if (PyTuple_Check(holder) && PyTuple_GET_SIZE(holder) == 1)
        return Py_NewRef(PyTuple_GET_ITEM(holder, 0));
    return NULL;
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
same_cells(PyObject *holder, PyObject *contents)
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
        if (expected == cfg_empty) {
            same = current == NULL;
        }
        else if (expected == cfg_ignored) {
            /* Still a value of an ignored type (not kept, so not compared). */
            if (current == NULL) {
                same = 0;
            }
            else {
                PyObject *kind = PyDict_GetItemWithError(cfg_kinds, (PyObject *)Py_TYPE(current));
                same = kind == NULL ? (PyErr_Occurred() ? -1 : 0)
                                    : PyObject_RichCompareBool(kind, cfg_ignore, Py_EQ);
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

/* What `reads_hold` answers: 1, 0, or -1 with an exception set. */
static int
closure_reads_hold(PyObject *reads)
{
    if (!PyTuple_Check(reads) || PyTuple_GET_SIZE(reads) != 7) {
        PyErr_SetString(PyExc_TypeError, "reads_hold(reads): reads is a 7-tuple");
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
        ok = same_cells(PyTuple_GET_ITEM(pair, 0), PyTuple_GET_ITEM(pair, 1));
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

/* ---- The fast-path record and its executor ----
 *
 * After a call, the Python pipeline (treemode._pipeline._callsite.fast_record)
 * emits a `FastRecord`, or None where a fast path cannot be trusted; a
 * `FastCall` (the base of treemode.jit's wrapper) executes it: match the
 * arguments and the closure's objects, call the compiled entry, write the new
 * values. Every doubt (a mismatch, a shared donated buffer, a trace JAX must
 * make, an unusual signal-hold state, other keyword names) is a miss, handed to
 * the one Python callback, `miss(self, error, args, kwargs)`: `error` is None, or
 * the exception the compiled entry raised. */

#define RECORD_VERSION 1

typedef struct {
    PyObject_HEAD
    PyObject *slots, *partial_args, *kw_names, *closure_reads, *closure_holders, *lifted_slots,
        *jitted, *donated, *kept, *trace;
} RecordObject;

/* The record's fields, in the order of `RecordObject` (after `version`). */
static char *record_fields[] = {
    "version", "slots", "partial_args", "kw_names", "closure_reads", "closure_holders",
    "lifted_slots", "jitted", "donated", "kept", "trace", NULL,
};
#define RECORD_OBJECTS 10

static PyTypeObject FastRecord_Type;

/* Whether `t` is a tuple whose items are None or weak references (or, with
 * `indices`, non-negative ints). */
static int
tuple_of(PyObject *t, int indices)
{
    if (!PyTuple_Check(t))
        return 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(t); i++) {
        PyObject *item = PyTuple_GET_ITEM(t, i);
        if (indices ? !PyLong_Check(item) || PyLong_AsSsize_t(item) < 0
                    : item != Py_None && !PyWeakref_CheckRef(item)) {
            PyErr_Clear();
            return 0;
        }
    }
    return 1;
}

static PyObject *
record_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *version = NULL, *f[RECORD_OBJECTS] = {NULL};
    PyTypeObject *t = &PyTuple_Type;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|$O!O!O!O!O!O!O!OOOO:FastRecord", record_fields,
                                     &PyLong_Type, &version, t, &f[0], t, &f[1], t, &f[2], t,
                                     &f[3], t, &f[4], t, &f[5], &f[6], &f[7], &f[8], &f[9]))
        return NULL;
    for (int i = -1; i < RECORD_OBJECTS; i++) {
        if ((i < 0 ? version : f[i]) == NULL)
            return PyErr_Format(PyExc_TypeError, "FastRecord: missing field %s",
                                record_fields[i + 1]);
    }
    if (PyLong_AsLong(version) != RECORD_VERSION)
        return PyErr_Format(PyExc_ValueError,
                            "FastRecord: a version %R record; this extension executes version %d",
                            version, RECORD_VERSION);
    PyObject *kw_names = f[2], *reads = f[3], *donated = f[7], *kept = f[8];
    int ok = PyTuple_GET_SIZE(reads) == 7 && tuple_of(f[0], 0) && tuple_of(f[5], 0) &&
             PyTuple_GET_SIZE(f[4]) == PyTuple_GET_SIZE(f[5]) && PyCallable_Check(f[6]) &&
             ((donated == Py_None && kept == Py_None) || (tuple_of(donated, 1) && tuple_of(kept, 1)));
    for (Py_ssize_t i = 0; ok && i < PyTuple_GET_SIZE(kw_names); i++)
        ok = PyUnicode_CheckExact(PyTuple_GET_ITEM(kw_names, i));
    for (Py_ssize_t i = 0; ok && i < 7; i++)
        ok = PyTuple_Check(PyTuple_GET_ITEM(reads, i));
    if (!ok) {
        PyErr_SetString(PyExc_TypeError,
                        "FastRecord: slots are None or weak references, kw_names str, "
                        "closure_reads 7 tuples, "
                        "lifted_slots weak references (one per closure holder), jitted a "
                        "callable, donated and kept both None or both tuples of indices");
        return NULL;
    }
    RecordObject *self = (RecordObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    PyObject **fields = &self->slots;
    for (int i = 0; i < RECORD_OBJECTS; i++)
        fields[i] = Py_NewRef(f[i]);
    return (PyObject *)self;
}

static int
record_traverse(RecordObject *self, visitproc visit, void *arg)
{
    return fields_traverse(&self->slots, RECORD_OBJECTS, visit, arg);
}

static int
record_clear(RecordObject *self)
{
    return fields_clear(&self->slots, RECORD_OBJECTS);
}

static void
record_dealloc(RecordObject *self)
{
    PyObject_GC_UnTrack(self);
    record_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

#define RECORD_MEMBER(name, doc) \
    {#name, T_OBJECT, offsetof(RecordObject, name), READONLY, doc}
static PyMemberDef record_members[] = {
    RECORD_MEMBER(slots, "per argument (bound ones first): None (an array) or a weak "
                         "reference to its Guarded"),
    RECORD_MEMBER(partial_args, "the arguments jit_partial bound"),
    RECORD_MEMBER(kw_names, "the names of the keyword arguments, in the slots' order"),
    RECORD_MEMBER(closure_reads, "the reads the closure search's answer depends on"),
    RECORD_MEMBER(closure_holders, "holders of the closure objects the search lifted"),
    RECORD_MEMBER(lifted_slots, "weak references to their Guarded"),
    RECORD_MEMBER(jitted, "the compiled entry: takes the arrays, or (donated, kept)"),
    RECORD_MEMBER(donated, "None, or the positions of the donated arrays"),
    RECORD_MEMBER(kept, "None, or the positions of the other arrays"),
    RECORD_MEMBER(trace, "the trace (its weak reference) the Variables may be written in"),
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject FastRecord_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "treemode._accel._guard.FastRecord",
    .tp_doc = PyDoc_STR("FastRecord(*, version, slots, partial_args, kw_names, closure_reads, "
                        "closure_holders, lifted_slots, jitted, donated, kept, trace): how a "
                        "repeated treemode.jit call runs, as the Python pipeline decided it."),
    .tp_basicsize = sizeof(RecordObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = record_new,
    .tp_traverse = (traverseproc)record_traverse,
    .tp_clear = (inquiry)record_clear,
    .tp_dealloc = (destructor)record_dealloc,
    .tp_members = record_members,
};

/* Donation: XLA cannot donate one buffer twice, nor a buffer also passed
 * undonated; a call where two of the arrays are one object is a miss (the
 * Python pipeline names the paths, or passes a shared Python number). */
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
        if (j < 0 || j >= PyList_GET_SIZE(arrays)) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_IndexError, "treemode: a donation index is out of range");
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, i, Py_NewRef(PyList_GET_ITEM(arrays, j)));
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

/* The signal hold of a donated call (treemode._pipeline._interrupts, whose
 * objects `configure` hands over): once the executable consumed the donated
 * buffers, the new values are the only whole state until written, so every
 * Python signal handler is swapped for a deferring one from before the call
 * to after the write. Made here in the common case only: the main thread, no
 * hold open, nothing deferred, and the handler table the one the Python hold
 * last planned its swaps for (`hold_plan`: [handlers, swaps]); anything else is
 * a miss, and the Python pipeline holds. */
static PyObject *
planned_swaps(void)
{
    if (PyList_GET_SIZE(hold_plan) != 2)
        return NULL;
    PyObject *handlers = PyList_GET_ITEM(hold_plan, 0), *swaps = PyList_GET_ITEM(hold_plan, 1);
    Py_ssize_t n = PyTuple_GET_SIZE(hold_signals_tuple);
    if (!PyTuple_Check(handlers) || !PyTuple_Check(swaps) || PyTuple_GET_SIZE(handlers) != n)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *handler = PyObject_CallOneArg(hold_getsignal, PyTuple_GET_ITEM(hold_signals_tuple, i));
        if (handler == NULL)
            return NULL;
        Py_DECREF(handler); /* only compared; the signal module holds it */
        if (handler != PyTuple_GET_ITEM(handlers, i))
            return NULL;
    }
    return Py_NewRef(swaps);
}

/* 1 while one of JAX's NaN/Inf checks (`debug_checks`) is on, 0 otherwise, -1 with
 * an exception: under one, a donated call runs undonated in the pipeline (JAX's
 * re-run that names the primitive needs the inputs alive). */
static int
debug_check_on(void)
{
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(debug_checks); i++) {
        PyObject *value = PyObject_GetAttr(PyTuple_GET_ITEM(debug_checks, i), value_name);
        if (value == NULL)
            return -1;
        int on = PyObject_IsTrue(value);
        Py_DECREF(value);
        if (on != 0)
            return on;
    }
    return 0;
}

/* The token (the swaps made, a new reference), None outside the main thread,
 * NULL with an exception (a pending signal's handler raised: nothing consumed
 * yet), or NULL without one: a miss. */
static PyObject *
hold_signals(PyObject *donated)
{
    if (PyThread_get_thread_ident() != hold_main_thread)
        Py_RETURN_NONE;
    if (PyList_GET_SIZE(hold_open) != 0 || PyList_GET_SIZE(hold_deferred) != 0)
        return NULL;
    PyObject *swaps = planned_swaps();
    if (swaps == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(swaps); i++) {
        PyObject *swap = PyTuple_GET_ITEM(swaps, i); /* (signum, original, deferring) */
        PyObject *args[2] = {PyTuple_GET_ITEM(swap, 0), PyTuple_GET_ITEM(swap, 2)};
        PyObject *old = PyObject_Vectorcall(hold_setsignal, args, 2, NULL);
        if (old == NULL) {
            Py_DECREF(swaps);
            return NULL;
        }
        Py_DECREF(old);
    }
    if (PyList_Append(hold_open, donated) < 0) {
        Py_DECREF(swaps);
        return NULL;
    }
    return swaps;
}

/* Sends the held signals again, the original handlers back: their handlers
 * run here, in the interpreter's order, the first exception raised. */
static int
deliver_deferred(void)
{
    Py_ssize_t n = PyList_GET_SIZE(hold_deferred);
    PyObject *deferred = PyList_GetSlice(hold_deferred, 0, n);
    if (deferred == NULL || PyList_SetSlice(hold_deferred, 0, n, NULL) < 0) {
        Py_XDECREF(deferred);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long signum = PyLong_AsLong(PyList_GET_ITEM(deferred, i));
        if (signum > 0)
            raise((int)signum); /* marks the handler as due (the main thread's) */
    }
    Py_DECREF(deferred);
    PyErr_Clear();
    return PyErr_CheckSignals();
}

/* The exception set, fetched as one normalized object with its traceback. */
static PyObject *
fetch_error(void)
{
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_NormalizeException(&type, &value, &traceback);
    if (traceback != NULL && value != NULL)
        PyException_SetTraceback(value, traceback);
    Py_XDECREF(type);
    Py_XDECREF(traceback);
    return value;
}

/* Raises `error` (stolen) again, with its traceback. */
static void
restore_error(PyObject *error)
{
    PyErr_Restore(Py_NewRef((PyObject *)Py_TYPE(error)), error, PyException_GetTraceback(error));
}

/* The exception set now gets `context` (stolen) as its context. */
static void
chain(PyObject *context)
{
    PyObject *raised = fetch_error();
    PyException_SetContext(raised, context);
    restore_error(raised);
}

/* Ends the hold `token` (stolen; None: there was none): the original handlers
 * back, then the held signals delivered. An exception already set stays the
 * one raised, unless a handler raises: that one is raised, with the first as
 * its context. Returns -1 when an exception is set after. */
static int
release_signals(PyObject *token)
{
    PyObject *pending = PyErr_Occurred() ? fetch_error() : NULL;
    int released = 0;
    if (token != Py_None) {
        Py_ssize_t n = PyList_GET_SIZE(hold_open);
        released = n > 0 ? PyList_SetSlice(hold_open, n - 1, n, NULL) : -1; /* close */
        for (Py_ssize_t i = 0; released == 0 && i < PyTuple_GET_SIZE(token); i++) {
            PyObject *swap = PyTuple_GET_ITEM(token, i);
            PyObject *args[2] = {PyTuple_GET_ITEM(swap, 0), PyTuple_GET_ITEM(swap, 1)};
            PyObject *old = PyObject_Vectorcall(hold_setsignal, args, 2, NULL);
            released = old == NULL ? -1 : 0; /* a new signal's handler raised */
            Py_XDECREF(old);
        }
        if (released == 0 && PyList_GET_SIZE(hold_deferred) != 0)
            released = deliver_deferred();
    }
    Py_DECREF(token);
    if (released == 0) {
        if (pending != NULL)
            restore_error(pending);
        return pending == NULL ? 0 : -1;
    }
    if (pending != NULL)
        chain(pending);
    return -1;
}

/* After a donated call a failed write cannot be undone (the old buffers were
 * consumed): it is finished instead, each new value stored in its Variable's
 * value slot (a Variable whose own setter refused included); the exception
 * raised stays the one raised. */
static void
finish_write(PyObject *variables, PyObject *updates)
{
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    descrsetfunc set = Py_TYPE(raw_value_member)->tp_descr_set;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(variables); i++) {
        PyObject *update = PyTuple_GET_ITEM(updates, i);
        if (update != Py_None && set(raw_value_member, PyList_GET_ITEM(variables, i), update) < 0)
            PyErr_Clear();
    }
    PyErr_Restore(type, value, traceback);
}

/* Executes `r` on `args`: the call's output; or NULL with `*error` set to the
 * exception the compiled entry raised (the miss explains it); or NULL with an
 * exception set (raised as it is: a failed write, undone, or finished after a
 * donated call); or NULL without either: a miss. */
static PyObject *
execute(RecordObject *r, PyObject *args, PyObject *kwargs, PyObject **error)
{
    PyObject *roots = NULL, *result = NULL, *out = NULL, *token = NULL, *split[2] = {NULL, NULL};
    PyObject *dynamic = PyList_New(0), *variables = PyList_New(0);
    int ok;
    if (dynamic == NULL || variables == NULL)
        goto done;
    /* The roots: the bound arguments, the positional ones, the keyword ones by name. */
    Py_ssize_t n_partial = PyTuple_GET_SIZE(r->partial_args), n_args = PyTuple_GET_SIZE(args);
    Py_ssize_t n_kw = PyTuple_GET_SIZE(r->kw_names);
    if ((kwargs == NULL ? 0 : PyDict_GET_SIZE(kwargs)) != n_kw ||
        n_partial + n_args + n_kw != PyTuple_GET_SIZE(r->slots))
        goto done;
    if (n_partial == 0 && n_kw == 0) {
        roots = Py_NewRef(args);
    }
    else {
        roots = PyTuple_New(n_partial + n_args + n_kw);
        if (roots == NULL)
            goto done;
        for (Py_ssize_t i = 0; i < n_partial; i++)
            PyTuple_SET_ITEM(roots, i, Py_NewRef(PyTuple_GET_ITEM(r->partial_args, i)));
        for (Py_ssize_t i = 0; i < n_args; i++)
            PyTuple_SET_ITEM(roots, n_partial + i, Py_NewRef(PyTuple_GET_ITEM(args, i)));
        for (Py_ssize_t i = 0; i < n_kw; i++) {
            PyObject *value = PyDict_GetItemWithError(kwargs, PyTuple_GET_ITEM(r->kw_names, i));
            if (value == NULL)
                goto done; /* another name (a miss), or an error */
            PyTuple_SET_ITEM(roots, n_partial + n_args + i, Py_NewRef(value));
        }
    }
    /* The Variables may be written in the record's trace only. */
    PyObject *trace = PyObject_GetAttr(trace_state, trace_attr);
    if (trace == NULL)
        goto done;
    Py_DECREF(trace); /* only compared; the record holds its own */
    if (trace != r->trace)
        goto done;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(r->slots); i++) {
        ok = match_one(PyTuple_GET_ITEM(r->slots, i), PyTuple_GET_ITEM(roots, i), dynamic,
                       variables);
        if (ok != 1)
            goto done;
    }
    if (closure_reads_hold(r->closure_reads) != 1)
        goto done;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(r->closure_holders); i++) {
        PyObject *obj = held(PyTuple_GET_ITEM(r->closure_holders, i));
        if (obj == NULL)
            goto done; /* the object died */
        ok = match_one(PyTuple_GET_ITEM(r->lifted_slots, i), obj, dynamic, variables);
        Py_DECREF(obj);
        if (ok != 1)
            goto done;
    }
    if (r->donated == Py_None) {
        result = PyObject_Vectorcall(r->jitted, PySequence_Fast_ITEMS(dynamic),
                                     PyList_GET_SIZE(dynamic), NULL);
    }
    else {
        split[0] = pick(dynamic, r->donated);
        split[1] = split[0] == NULL ? NULL : pick(dynamic, r->kept);
        if (split[1] == NULL || shares_an_object(split[0], split[1]) != 0)
            goto done;
        if (debug_check_on() != 0) {
            PyErr_Clear(); /* a miss: the pipeline reads the flags again */
            goto done;
        }
        token = hold_signals(split[0]);
        if (token == NULL)
            goto done;
        result = PyObject_Vectorcall(r->jitted, split, 2, NULL);
    }
    if (result == NULL) {
        *error = fetch_error();
        goto done;
    }
    if (!PyTuple_Check(result) || PyTuple_GET_SIZE(result) != 2) {
        PyErr_SetString(PyExc_SystemError, "treemode: a compiled entry returns (out, updates)");
        goto done;
    }
    PyObject *updates = PyTuple_GET_ITEM(result, 1);
    if (updates != Py_None) { /* None: the trace updates nothing */
        if (!PyTuple_Check(updates) || PyTuple_GET_SIZE(updates) != PyList_GET_SIZE(variables)) {
            PyErr_SetString(PyExc_SystemError,
                            "treemode: a compiled entry's updates differ from its record's Variables");
            goto done;
        }
        if (write_all(variables, updates) < 0) {
            if (r->donated != Py_None)
                finish_write(variables, updates);
            goto done;
        }
    }
    out = Py_NewRef(PyTuple_GET_ITEM(result, 0));
done:
    if (token != NULL && release_signals(token) < 0) {
        Py_CLEAR(out); /* a held signal's exception, raised after the write */
        if (*error != NULL) {
            chain(*error);
            *error = NULL;
        }
    }
    Py_XDECREF(result);
    Py_XDECREF(split[0]);
    Py_XDECREF(split[1]);
    Py_XDECREF(variables);
    Py_XDECREF(dynamic);
    Py_XDECREF(roots);
    return out;
}

/* FastCall: the base of a callable whose calls execute one of its `_records`
 * (a tuple of FastRecords, the most recently made first; one per set of
 * objects the callable was called with), and go to
 * `_miss(self, error, args, kwargs)` otherwise (`_miss` is a function, not a
 * bound method: no reference cycle). A record that does not match passes the
 * call to the next one; a record that matched and whose compiled entry
 * raised hands the error to the miss. */
typedef struct {
    PyObject_HEAD
    PyObject *records;
    PyObject *miss;
} FastCallObject;

static PyObject *
fast_call(PyObject *self, PyObject *args, PyObject *kwargs)
{
    FastCallObject *f = (FastCallObject *)self;
    PyObject *error = NULL;
    if (f->records != NULL && PyTuple_Check(f->records) && is_configured) {
        PyObject *records = Py_NewRef(f->records); /* another thread may replace them */
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(records) && error == NULL; i++) {
            PyObject *record = PyTuple_GET_ITEM(records, i);
            if (!Py_IS_TYPE(record, &FastRecord_Type))
                continue;
            PyObject *result = execute((RecordObject *)record, args, kwargs, &error);
            if (result != NULL || (error == NULL && PyErr_Occurred())) {
                Py_DECREF(records);
                return result;
            }
        }
        Py_DECREF(records);
    }
    if (f->miss == NULL || f->miss == Py_None) {
        Py_XDECREF(error);
        PyErr_SetString(PyExc_TypeError, "FastCall: no miss callback was set");
        return NULL;
    }
    PyObject *call_args[4] = {self, error ? error : Py_None, args, kwargs ? kwargs : Py_None};
    PyObject *result = PyObject_Vectorcall(f->miss, call_args, 4, NULL);
    Py_XDECREF(error);
    return result;
}

static int
fast_call_traverse(FastCallObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    return fields_traverse(&self->records, 2, visit, arg); /* records, miss */
}

static int
fast_call_clear(FastCallObject *self)
{
    return fields_clear(&self->records, 2);
}

static void
fast_call_dealloc(FastCallObject *self)
{
    PyObject_GC_UnTrack(self);
    fast_call_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef fast_call_members[] = {
    {"_records", T_OBJECT, offsetof(FastCallObject, records), 0,
     "a tuple of the FastRecords a call may execute, tried in order (anything "
     "else: every call misses)"},
    {"_miss", T_OBJECT, offsetof(FastCallObject, miss), 0,
     "miss(self, error, args, kwargs): runs a call the record does not"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject FastCall_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "treemode._accel._guard.FastCall",
    .tp_doc = PyDoc_STR("Base of a callable whose calls execute its fast-path record, and "
                        "call its `_miss` otherwise."),
    .tp_basicsize = sizeof(FastCallObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_call = fast_call,
    .tp_traverse = (traverseproc)fast_call_traverse,
    .tp_clear = (inquiry)fast_call_clear,
    .tp_dealloc = (destructor)fast_call_dealloc,
    .tp_members = fast_call_members,
};

/* configure(**fields): see treemode._accel._compiled.configure. */
static char *configure_fields[] = {
    "raw_value", "metadata", "trace_state", "trace_attr", "array_types", "closure_kinds",
    "closure_ignore", "closure_empty", "closure_ignored", "hold_open", "hold_deferred",
    "hold_plan", "signals", "getsignal", "setsignal", "main_thread", "debug_checks", NULL,
};
#define CONFIGURE_OBJECTS 17

static int
object_slot_member(PyObject *descr)
{
    return Py_IS_TYPE(descr, &PyMemberDescr_Type) &&
           ((PyMemberDescrObject *)descr)->d_member->type == T_OBJECT_EX &&
           !(((PyMemberDescrObject *)descr)->d_member->flags & READONLY);
}

PyDoc_STRVAR(configure_doc,
"configure(**fields) -> None\n\n"
"Set what the C code reads, by keyword (CONFIGURE_FIELDS; documented by\n"
"treemode._accel._compiled.configure).");

static PyObject *
configure(PyObject *Py_UNUSED(module), PyObject *args, PyObject *kwds)
{
    PyObject *f[CONFIGURE_OBJECTS] = {NULL};
    PyTypeObject *list = &PyList_Type;
    if (!PyArg_ParseTupleAndKeywords(
            args, kwds, "|$OOOO!O!O!OOOO!O!O!O!OOO!O!:configure", configure_fields, &f[0],
            &f[1], &f[2], &PyUnicode_Type, &f[3], &PySet_Type, &f[4], &PyDict_Type, &f[5], &f[6],
            &f[7], &f[8], list, &f[9], list, &f[10], list, &f[11], &PyTuple_Type, &f[12], &f[13],
            &f[14], &PyLong_Type, &f[15], &PyTuple_Type, &f[16]))
        return NULL;
    for (int i = 0; i < CONFIGURE_OBJECTS; i++) {
        if (f[i] == NULL)
            return PyErr_Format(PyExc_TypeError, "configure: missing %s", configure_fields[i]);
    }
    unsigned long main_thread = PyLong_AsUnsignedLong(f[15]);
    if (PyErr_Occurred())
        return NULL;
    if (!object_slot_member(f[0]) || !object_slot_member(f[1]) || !PyCallable_Check(f[13]) ||
        !PyCallable_Check(f[14])) {
        malformed("configure: raw_value, metadata: object-slot member descriptors; "
                  "getsignal, setsignal: callables");
        return NULL;
    }
    PyObject **targets[CONFIGURE_OBJECTS - 2] = {
        &raw_value_member, &metadata_member, &trace_state, &trace_attr, &cfg_array_types,
        &cfg_kinds, &cfg_ignore, &cfg_empty, &cfg_ignored, &hold_open, &hold_deferred,
        &hold_plan, &hold_signals_tuple, &hold_getsignal, &hold_setsignal,
    };
    for (int i = 0; i < CONFIGURE_OBJECTS - 2; i++)
        Py_XSETREF(*targets[i], Py_NewRef(f[i]));
    if (value_name == NULL && (value_name = PyUnicode_InternFromString("value")) == NULL)
        return NULL;
    Py_XSETREF(debug_checks, Py_NewRef(f[16]));
    raw_value_name = PyDescr_NAME(raw_value_member);
    metadata_name = PyDescr_NAME(metadata_member);
    hold_main_thread = main_thread;
    /* The Variable slots may be other descriptors now. */
    slot_cache_clear(&raw_value_slots);
    slot_cache_clear(&metadata_slots);
    is_configured = 1;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"configure", (PyCFunction)(void (*)(void))configure, METH_VARARGS | METH_KEYWORDS,
     configure_doc},
    {"holds", (PyCFunction)(void (*)(void))holds, METH_FASTCALL, holds_doc},
    {"version_tags", (PyCFunction)version_tags, METH_O, version_tags_doc},
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

/* A tuple of the names in `names` (NULL-terminated), from `first` on. */
static int
add_names(PyObject *module, const char *attr, char **names, int first)
{
    int n = 0;
    while (names[n] != NULL)
        n++;
    PyObject *tuple = PyTuple_New(n - first);
    for (int i = first; tuple != NULL && i < n; i++) {
        PyObject *name = PyUnicode_InternFromString(names[i]);
        if (name == NULL)
            Py_CLEAR(tuple);
        else
            PyTuple_SET_ITEM(tuple, i - first, name);
    }
    if (tuple == NULL || PyModule_AddObject(module, attr, tuple) < 0) {
        Py_XDECREF(tuple);
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
    if (intern_once(&code_name, "__code__") == NULL ||
        intern_once(&closure_name, "__closure__") == NULL ||
        intern_once(&dict_name, "__dict__") == NULL)
        return -1;
    if (add_type(module, "Guarded", &Guarded_Type) < 0 ||
        add_type(module, "FastRecord", &FastRecord_Type) < 0 ||
        add_type(module, "FastCall", &FastCall_Type) < 0 ||
        PyModule_AddIntConstant(module, "RECORD_VERSION", RECORD_VERSION) < 0 ||
        add_names(module, "RECORD_FIELDS", record_fields, 0) < 0 ||
        add_names(module, "CONFIGURE_FIELDS", configure_fields, 0) < 0 ||
        add_names(module, "GUARD_STATE_FIELDS", guard_state_fields, 0) < 0)
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
    .m_doc = "treemode's optional compiled extension (see treemode/_accel/_compiled.py).",
    .m_size = 0,
    .m_methods = methods,
    .m_slots = module_slots,
};

PyMODINIT_FUNC
PyInit__guard(void)
{
    return PyModuleDef_Init(&module_def);
}
