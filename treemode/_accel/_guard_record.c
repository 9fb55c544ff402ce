/* The fast-path record, `FastRecord` (declarations: _guard.h).
 *
 * What a miss concludes about the calls like it, made by the Python pipeline
 * (treemode._pipeline._callsite.fast_record) and executed by `FastCall`
 * (_guard_executor.c): a frozen, versioned C structure whose constructor
 * checks every field (their names: `RECORD_FIELDS`, defined once in
 * treemode/_accel/_border.py), read by the executor without calling Python.
 */
#include "_guard.h"

/* The record's fields, in the order of `tm_record` (after `version`). */
static char *record_fields[] = {TM_RECORD_FIELD_NAMES, NULL};
#define RECORD_OBJECTS (TM_RECORD_SIZE - 1)

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
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|$O!OO!O!O!O!O!O!OOOOO!O!:FastRecord",
                                     record_fields, &PyLong_Type, &version, &f[0], t, &f[1], t,
                                     &f[2], t, &f[3], t, &f[4], t, &f[5], t, &f[6], &f[7], &f[8],
                                     &f[9], &f[10], t, &f[11], t, &f[12]))
        return NULL;
    for (int i = -1; i < RECORD_OBJECTS; i++) {
        if ((i < 0 ? version : f[i]) == NULL)
            return PyErr_Format(PyExc_TypeError, "FastRecord: missing field %s",
                                record_fields[i + 1]);
    }
    if (PyLong_AsLong(version) != TM_RECORD_VERSION_NUMBER)
        return PyErr_Format(PyExc_ValueError,
                            "FastRecord: a version %R record; this extension executes version %d",
                            version, TM_RECORD_VERSION_NUMBER);
    /* f[i] is the field TM_RECORD_<NAME> (version is field 0). */
#define FIELD(name) f[TM_RECORD_##name - 1]
    PyObject *kw_names = FIELD(KW_NAMES), *reads = FIELD(CLOSURE_READS);
    PyObject *donated = FIELD(DONATED), *kept = FIELD(KEPT);
    int ok = PyTuple_GET_SIZE(reads) == TM_READS_SIZE && tuple_of(FIELD(SLOTS), 0) &&
             tuple_of(FIELD(LIFTED_SLOTS), 0) &&
             PyTuple_GET_SIZE(FIELD(CLOSURE_HOLDERS)) == PyTuple_GET_SIZE(FIELD(LIFTED_SLOTS)) &&
             PyCallable_Check(FIELD(JITTED)) &&
             ((donated == Py_None && kept == Py_None) || (tuple_of(donated, 1) && tuple_of(kept, 1))) &&
             tuple_of(FIELD(CHECKED), 1) &&
             PyTuple_GET_SIZE(FIELD(CHECKED)) == PyTuple_GET_SIZE(FIELD(AVALS));
#undef FIELD
    for (Py_ssize_t i = 0; ok && i < PyTuple_GET_SIZE(kw_names); i++)
        ok = PyUnicode_CheckExact(PyTuple_GET_ITEM(kw_names, i));
    for (Py_ssize_t i = 0; ok && i < TM_READS_SIZE; i++)
        ok = PyTuple_Check(PyTuple_GET_ITEM(reads, i));
    if (!ok) {
        PyErr_SetString(PyExc_TypeError,
                        "FastRecord: slots are None or weak references, kw_names str, "
                        "closure_reads 7 tuples, "
                        "lifted_slots weak references (one per closure holder), jitted a "
                        "callable, donated and kept both None or both tuples of indices, "
                        "checked a tuple of indices and avals a tuple of as many");
        return NULL;
    }
    tm_record *self = (tm_record *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    PyObject **fields = &self->key;
    for (int i = 0; i < RECORD_OBJECTS; i++)
        fields[i] = Py_NewRef(f[i]);
    return (PyObject *)self;
}

static int
record_traverse(tm_record *self, visitproc visit, void *arg)
{
    return tm_fields_traverse(&self->key, RECORD_OBJECTS, visit, arg);
}

static int
record_clear(tm_record *self)
{
    return tm_fields_clear(&self->key, RECORD_OBJECTS);
}

static void
record_dealloc(tm_record *self)
{
    PyObject_GC_UnTrack(self);
    record_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

#define RECORD_MEMBER(name, doc) \
    {#name, T_OBJECT, offsetof(tm_record, name), READONLY, doc}
static PyMemberDef record_members[] = {
    RECORD_MEMBER(key, "what tells this record from the others of its table (==): "
                       "the objects and the signature it was made for"),
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
    RECORD_MEMBER(checked, "positions of the arrays whose abstract values are checked"),
    RECORD_MEMBER(avals, "what typeof must give for each of them (==)"),
    {NULL, 0, 0, 0, NULL},
};

PyTypeObject tm_record_type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "treemode._accel._guard.FastRecord",
    .tp_doc = PyDoc_STR("FastRecord(*, version, key, slots, partial_args, kw_names, "
                        "closure_reads, closure_holders, lifted_slots, jitted, donated, kept, "
                        "trace, checked, avals): how a repeated treemode.jit call runs, as the "
                        "Python pipeline decided it."),
    .tp_basicsize = sizeof(tm_record),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = record_new,
    .tp_traverse = (traverseproc)record_traverse,
    .tp_clear = (inquiry)record_clear,
    .tp_dealloc = (destructor)record_dealloc,
    .tp_members = record_members,
};

/* Adds the record's type, its version and its fields' names. */
int
tm_record_exec(PyObject *module)
{
    if (tm_add_type(module, "FastRecord", &tm_record_type) < 0 ||
        PyModule_AddIntConstant(module, "RECORD_VERSION", TM_RECORD_VERSION_NUMBER) < 0 ||
        tm_add_names(module, "RECORD_FIELDS", record_fields) < 0)
        return -1;
    return 0;
}
