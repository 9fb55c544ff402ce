/* The guard and the closure-read check of treemode's extension (declarations:
 * _guard.h), each with a Python twin bound to it by tests/test_twins.py.
 *
 * The guard: a cached flattening stays valid while every container it walked
 * through still holds the very same objects; `holds` compares the guard state
 * `Guard` (treemode/_tree/_flat_guard.py) saved with the current contents by
 * pointer, calling no Python code but one attribute read per Variable and per
 * `__dict__`. The guard state keeps every saved object alive, so equal pointers
 * mean the same object. The closure-read check (`tm_closure_reads_hold`, made
 * by the executor; its twin: treemode._tree._closure_reads.reads_hold_python) checks
 * that every read of a closure search still gives the same object.
 */
#include "_guard.h"

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

/* Whether `container` (a dict or a list) has `expected` entries: 1, 0, or -1. */
static int
same_length(PyObject *container, PyObject *expected)
{
    if (!(PyDict_Check(container) || PyList_Check(container)) || !PyLong_Check(expected))
        return tm_malformed("a guard state's sized containers are dicts or lists, lengths ints");
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
        return tm_malformed("a guard state's ordered containers are dicts or lists");
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
        return tm_malformed("a guard state's value-checked containers are dicts");
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
Py_ssize_t
tm_raw_value_offset(PyTypeObject *type)
{
    return slot_offset_of(type, tm_raw_value_name, tm_raw_value_member, &raw_value_slots);
}

static Py_ssize_t
metadata_offset(PyTypeObject *type)
{
    return slot_offset_of(type, tm_metadata_name, tm_metadata_member, &metadata_slots);
}

static void
slot_cache_clear(SlotCache *cache)
{
    for (int i = 0; i < cache->n; i++)
        Py_CLEAR(cache->types[i]);
    cache->n = 0;
}

/* Forgets every type's slots (`configure` may name other descriptors). */
void
tm_slot_caches_clear(void)
{
    slot_cache_clear(&raw_value_slots);
    slot_cache_clear(&metadata_slots);
}

/* Whether `obj.__dict__` is `expected`: 1, 0, or -1 with the exception raised. */
static int
dict_is(PyObject *obj, PyObject *expected)
{
    PyObject *current = PyObject_GetAttr(obj, tm_dict_name);
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
        return tm_malformed("a guard state's metadata entries are tuples");
    Py_ssize_t offset = metadata_offset(Py_TYPE(var));
    if (offset >= 0) {
        PyObject *current = *(PyObject **)((char *)var + offset); /* borrowed; NULL if unset */
        if (current != expected || !PyDict_Check(current))
            return 0;
        return unmodified(current, tags, i) ? 1 : same_entries(current, entries);
    }
    PyObject *current = PyObject_GetAttr(var, tm_metadata_name);
    if (current == NULL) {
        PyErr_Clear(); /* no metadata any more: not the flattening's Variable */
        return 0;
    }
    int same = current == expected && PyDict_Check(current) &&
               (unmodified(current, tags, i) || same_entries(current, entries));
    Py_DECREF(current);
    return same;
}

/* The fields of a guard state (built by treemode._tree._flat_guard.Guard), then,
 * where the interpreter has dict version tags, three tags. */
/* The fields of a guard state (named in treemode/_accel/_border.py, which
 * treemode._tree._flat_guard.Guard builds a state by): the untagged ones, then,
 * where the interpreter has dict version tags, the three tags. */
#define ST_FIELDS (TM_STATE_SIZE - TM_STATE_TAGS)
#define ST_TAGGED_FIELDS TM_STATE_SIZE
#define ST_TUPLES TM_STATE_TOP_TYPE /* the fields before it are tuples */
static char *guard_state_fields[] = {TM_STATE_FIELD_NAMES, NULL};

/* Whether the snapshot `state` (see `holds` below) still describes its
 * containers, the Variables in `variables` (a list or tuple) and the top-level
 * argument `top`: 1, 0, or -1 with an exception set. */
int
tm_state_holds(PyObject *state, PyObject *variables, PyObject *top)
{
    if (!tm_configured())
        return -1;
    if (!PyTuple_Check(state) ||
        (PyTuple_GET_SIZE(state) != ST_FIELDS && PyTuple_GET_SIZE(state) != ST_TAGGED_FIELDS))
        return tm_malformed("a guard state is a 15-tuple, or 18 with version tags");
    for (Py_ssize_t i = 0; i < ST_TUPLES; i++) {
        if (!PyTuple_Check(PyTuple_GET_ITEM(state, i)))
            return tm_malformed("the first 13 items of a guard state are tuples");
    }
#define ST_LEN(i) PyTuple_GET_SIZE(PyTuple_GET_ITEM(state, (i)))
    if (ST_LEN(TM_STATE_SIZED) != ST_LEN(TM_STATE_LENS) || ST_LEN(TM_STATE_METADATA) != ST_LEN(TM_STATE_METADATA_ENTRIES) ||
        ST_LEN(TM_STATE_NODES) != ST_LEN(TM_STATE_NODE_TYPES) || ST_LEN(TM_STATE_OWNERS) != ST_LEN(TM_STATE_OWNER_DICTS) ||
        ST_LEN(TM_STATE_VARIABLE_TYPES) != ST_LEN(TM_STATE_METADATA))
        return tm_malformed("a guard state has one length per sized container, one entries "
                         "tuple per metadata dict, one type per node and per Variable, and "
                         "one dict per owner");
#undef ST_LEN
    PyObject *sized = PyTuple_GET_ITEM(state, TM_STATE_SIZED);
    PyObject *lens = PyTuple_GET_ITEM(state, TM_STATE_LENS);
    PyObject *dicts = PyTuple_GET_ITEM(state, TM_STATE_DICTS);
    PyObject *values = PyTuple_GET_ITEM(state, TM_STATE_VALUES);
    PyObject *ordered = PyTuple_GET_ITEM(state, TM_STATE_ORDERED);
    PyObject *items = PyTuple_GET_ITEM(state, TM_STATE_ITEMS);
    PyObject *metadata = PyTuple_GET_ITEM(state, TM_STATE_METADATA);
    PyObject *metadata_entries = PyTuple_GET_ITEM(state, TM_STATE_METADATA_ENTRIES);
    PyObject *nodes = PyTuple_GET_ITEM(state, TM_STATE_NODES);
    PyObject *node_types = PyTuple_GET_ITEM(state, TM_STATE_NODE_TYPES);
    PyObject *owners = PyTuple_GET_ITEM(state, TM_STATE_OWNERS);
    PyObject *owner_dicts = PyTuple_GET_ITEM(state, TM_STATE_OWNER_DICTS);
    PyObject *variable_types = PyTuple_GET_ITEM(state, TM_STATE_VARIABLE_TYPES);
    PyObject *top_type = PyTuple_GET_ITEM(state, TM_STATE_TOP_TYPE);
    PyObject *top_dict = PyTuple_GET_ITEM(state, TM_STATE_TOP_DICT);
    int tagged = PyTuple_GET_SIZE(state) == ST_TAGGED_FIELDS;
    const uint64_t *dict_tags =
        tagged ? saved_tags(PyTuple_GET_ITEM(state, TM_STATE_DICT_TAGS), PyTuple_GET_SIZE(dicts)) : NULL;
    const uint64_t *ordered_tags =
        tagged ? saved_tags(PyTuple_GET_ITEM(state, TM_STATE_ORDERED_TAGS), PyTuple_GET_SIZE(ordered))
               : NULL;
    const uint64_t *metadata_tags =
        tagged ? saved_tags(PyTuple_GET_ITEM(state, TM_STATE_METADATA_TAGS), PyTuple_GET_SIZE(metadata))
               : NULL;
    Py_ssize_t k;
    int same;

    /* Types and __dict__ objects first (as Guard.holds): the passes below read
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
"state's fields: GUARD_STATE_FIELDS, built by treemode._tree._flat_guard.Guard).");

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
    int ok = tm_state_holds(args[0], variables, args[2]);
    Py_DECREF(variables);
    if (ok < 0)
        return NULL;
    return PyBool_FromLong(ok);
}

/* The object a weak reference points to (a new reference), or NULL (no
 * exception) once it is dead. */
PyObject *
tm_referent(PyObject *ref)
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

/* The object a holder of the closure snapshot gives (a weak reference, or a
 * 1-tuple for an object that cannot be weakly referenced): a new reference,
 * or NULL (no exception) if it is gone or the holder is neither. */
PyObject *
tm_held(PyObject *holder)
{
    if (PyWeakref_CheckRef(holder))
        return tm_referent(holder);
    if (PyTuple_Check(holder) && PyTuple_GET_SIZE(holder) == TM_HOLDER_SIZE)
        return Py_NewRef(PyTuple_GET_ITEM(holder, TM_HOLDER_OBJ));
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
    PyObject *f = tm_held(holder);
    if (f == NULL)
        return 0;
    PyObject *cells = PyObject_GetAttr(f, tm_closure_name);
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
        if (expected == tm_closure_empty) {
            same = current == NULL;
        }
        else if (expected == tm_closure_ignored) {
            /* Still a value of an ignored type (not kept, so not compared). */
            if (current == NULL) {
                same = 0;
            }
            else {
                PyObject *kind = PyDict_GetItemWithError(tm_closure_kinds, (PyObject *)Py_TYPE(current));
                same = kind == NULL ? (PyErr_Occurred() ? -1 : 0)
                                    : PyObject_RichCompareBool(kind, tm_closure_ignore, Py_EQ);
            }
        }
        else {
            PyObject *obj = tm_held(expected);
            same = obj != NULL && obj == current;
            Py_XDECREF(obj);
        }
    }
    Py_DECREF(cells);
    return same;
}

/* Whether every closure read still gives the same object: 1, 0, or -1 with an exception set
 * (its Python twin: treemode._tree._closure_reads.reads_hold_python). */
int
tm_closure_reads_hold(PyObject *reads)
{
    if (!PyTuple_Check(reads) || PyTuple_GET_SIZE(reads) != TM_READS_SIZE) {
        PyErr_SetString(PyExc_TypeError, "closure reads: not what _border.closure_reads builds");
        return -1;
    }
    for (Py_ssize_t i = 0; i < TM_READS_SIZE; i++) {
        if (!PyTuple_Check(PyTuple_GET_ITEM(reads, i))) {
            PyErr_SetString(PyExc_TypeError, "closure reads: every read group is a tuple");
            return -1;
        }
    }
    PyObject *dicts = PyTuple_GET_ITEM(reads, TM_READS_DICTS);
    PyObject *names = PyTuple_GET_ITEM(reads, TM_READS_NAMES);
    PyObject *values = PyTuple_GET_ITEM(reads, TM_READS_VALUES);
    PyObject *functions = PyTuple_GET_ITEM(reads, TM_READS_FUNCTIONS);
    PyObject *codes = PyTuple_GET_ITEM(reads, TM_READS_CODES);
    PyObject *cells = PyTuple_GET_ITEM(reads, TM_READS_CELLS);
    PyObject *attrs = PyTuple_GET_ITEM(reads, TM_READS_ATTRS);
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
        PyObject *f = tm_held(PyTuple_GET_ITEM(functions, i));
        PyObject *code = PyTuple_GET_ITEM(codes, i);
        ok = f != NULL && (PyFunction_Check(f) ? PyFunction_GET_CODE(f) == code
                                               : attribute_is(f, tm_code_name, code));
        Py_XDECREF(f);
    }
    for (Py_ssize_t i = 0; ok == 1 && i < PyTuple_GET_SIZE(cells); i++) {
        PyObject *pair = PyTuple_GET_ITEM(cells, i);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != TM_CELL_READ_SIZE ||
            !PyTuple_Check(PyTuple_GET_ITEM(pair, TM_CELL_READ_CONTENTS))) {
            PyErr_SetString(PyExc_TypeError, "closure reads: a cell read is (holder, contents)");
            return -1;
        }
        ok = same_cells(PyTuple_GET_ITEM(pair, TM_CELL_READ_HOLDER),
                        PyTuple_GET_ITEM(pair, TM_CELL_READ_CONTENTS));
    }
    for (Py_ssize_t i = 0; ok == 1 && i < PyTuple_GET_SIZE(attrs); i++) {
        PyObject *triple = PyTuple_GET_ITEM(attrs, i);
        if (!PyTuple_Check(triple) || PyTuple_GET_SIZE(triple) != TM_ATTRIBUTE_READ_SIZE) {
            PyErr_SetString(PyExc_TypeError, "closure reads: an attribute read is (owner, name, value)");
            return -1;
        }
        ok = attribute_is(PyTuple_GET_ITEM(triple, TM_ATTRIBUTE_READ_OWNER),
                          PyTuple_GET_ITEM(triple, TM_ATTRIBUTE_READ_NAME),
                          PyTuple_GET_ITEM(triple, TM_ATTRIBUTE_READ_VALUE));
    }
    return ok;
}

static PyMethodDef kernel_methods[] = {
    {"holds", (PyCFunction)(void (*)(void))holds, METH_FASTCALL, holds_doc},
    {"version_tags", (PyCFunction)version_tags, METH_O, version_tags_doc},
    {NULL, NULL, 0, NULL},
};

/* Adds the kernels and the names of a guard state's fields to the module. */
int
tm_kernels_exec(PyObject *module)
{
    if (PyModule_AddFunctions(module, kernel_methods) < 0 ||
        tm_add_names(module, "GUARD_STATE_FIELDS", guard_state_fields) < 0)
        return -1;
    return 0;
}
