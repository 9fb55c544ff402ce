/* Identity checks behind treemode's flattening cache (see treemode/_flatten.py).
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

static PyObject *metadata_name; /* interned "_var_metadata" */

/* Whether `container` (a dict or a list) has `expected` entries. */
static int
same_length(PyObject *container, PyObject *expected)
{
    Py_ssize_t n = PyDict_Check(container) ? PyDict_GET_SIZE(container)
                                           : PyList_GET_SIZE(container);
    Py_ssize_t want = PyLong_AsSsize_t(expected);
    return want == n;
}

/* Whether iterating `container` (a dict's keys, or a list's items) gives
 * items[*k], items[*k + 1], ... by identity; advances *k. */
static int
same_iteration(PyObject *container, PyObject *items, Py_ssize_t *k)
{
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

/* Where a Variable type keeps `_var_metadata`: the offset of its __slots__
 * entry, or -1 to read it with getattr. Resolved once per type; the types are
 * held (a few Variable classes), so a cached address is never another type's. */
#define SLOT_CACHE_SIZE 32
static PyTypeObject *slot_types[SLOT_CACHE_SIZE];
static Py_ssize_t slot_offsets[SLOT_CACHE_SIZE];
static int n_slot_types;

static Py_ssize_t
metadata_offset(PyTypeObject *type)
{
    for (int i = 0; i < n_slot_types; i++) {
        if (slot_types[i] == type)
            return slot_offsets[i];
    }
    Py_ssize_t offset = -1;
    /* On the class, a slot's member descriptor returns itself. */
    PyObject *descr = PyObject_GetAttr((PyObject *)type, metadata_name);
    if (descr == NULL) {
        PyErr_Clear();
    }
    else {
        if (Py_IS_TYPE(descr, &PyMemberDescr_Type)) {
            PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
            if (member->type == T_OBJECT_EX)
                offset = member->offset;
        }
        Py_DECREF(descr);
    }
    if (n_slot_types < SLOT_CACHE_SIZE) {
        Py_INCREF(type);
        slot_types[n_slot_types] = type;
        slot_offsets[n_slot_types] = offset;
        n_slot_types++;
    }
    return offset;
}

/* Whether `var`'s `_var_metadata` is `expected`, holding exactly `entries`. */
static int
same_metadata(PyObject *var, PyObject *expected, PyObject *entries)
{
    Py_ssize_t offset = metadata_offset(Py_TYPE(var));
    if (offset >= 0) {
        PyObject *current = *(PyObject **)((char *)var + offset); /* borrowed; NULL if unset */
        return current == expected && PyDict_Check(current) && same_entries(current, entries);
    }
    PyObject *current = PyObject_GetAttr(var, metadata_name);
    if (current == NULL) {
        PyErr_Clear(); /* no metadata any more: not the flattening's Variable */
        return 0;
    }
    int same = current == expected && PyDict_Check(current) && same_entries(current, entries);
    Py_DECREF(current);
    return same;
}

PyDoc_STRVAR(holds_doc,
"holds(state, variables) -> bool\n\n"
"Whether the containers and Variables of a flattening snapshot are unchanged.\n\n"
"state: (sized, lens, dicts, values, ordered, items, metadata, metadata_entries),\n"
"tuples built by treemode._flatten._Guard: the dicts/lists whose lengths are\n"
"checked and those lengths; the dicts whose values are checked and all those\n"
"values; the plain dicts/lists whose iteration is checked and all those items;\n"
"per Variable its metadata dict and that dict's entries (k0, v0, k1, v1, ...).\n"
"Every comparison is by identity.");

static PyObject *
holds(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyTuple_Check(args[0]) || PyTuple_GET_SIZE(args[0]) != 8) {
        PyErr_SetString(PyExc_TypeError, "holds(state, variables): state is an 8-tuple");
        return NULL;
    }
    PyObject *state = args[0];
    PyObject *sized = PyTuple_GET_ITEM(state, 0);
    PyObject *lens = PyTuple_GET_ITEM(state, 1);
    PyObject *dicts = PyTuple_GET_ITEM(state, 2);
    PyObject *values = PyTuple_GET_ITEM(state, 3);
    PyObject *ordered = PyTuple_GET_ITEM(state, 4);
    PyObject *items = PyTuple_GET_ITEM(state, 5);
    PyObject *metadata = PyTuple_GET_ITEM(state, 6);
    PyObject *metadata_entries = PyTuple_GET_ITEM(state, 7);
    PyObject *variables = PySequence_Fast(args[1], "variables must be a sequence");
    if (variables == NULL)
        return NULL;
    int ok = 0;
    Py_ssize_t k;

    /* Lengths first: they keep the element-wise passes below aligned. */
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(sized); i++) {
        if (!same_length(PyTuple_GET_ITEM(sized, i), PyTuple_GET_ITEM(lens, i)))
            goto done;
    }
    k = 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(dicts); i++) {
        if (!same_values(PyTuple_GET_ITEM(dicts, i), values, &k))
            goto done;
    }
    if (k != PyTuple_GET_SIZE(values))
        goto done;
    k = 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(ordered); i++) {
        if (!same_iteration(PyTuple_GET_ITEM(ordered, i), items, &k))
            goto done;
    }
    if (k != PyTuple_GET_SIZE(items))
        goto done;
    Py_ssize_t n_vars = PySequence_Fast_GET_SIZE(variables);
    if (n_vars != PyTuple_GET_SIZE(metadata))
        goto done;
    for (Py_ssize_t i = 0; i < n_vars; i++) {
        if (!same_metadata(PySequence_Fast_GET_ITEM(variables, i), PyTuple_GET_ITEM(metadata, i),
                           PyTuple_GET_ITEM(metadata_entries, i)))
            goto done;
    }
    ok = 1;
done:
    Py_DECREF(variables);
    if (PyErr_Occurred())
        return NULL;
    return PyBool_FromLong(ok);
}

static PyMethodDef methods[] = {
    {"holds", (PyCFunction)(void (*)(void))holds, METH_FASTCALL, holds_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    "treemode._guard",
    "Identity checks behind treemode's flattening cache (optional accelerator).",
    -1,
    methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC
PyInit__guard(void)
{
    metadata_name = PyUnicode_InternFromString("_var_metadata");
    if (metadata_name == NULL)
        return NULL;
    return PyModule_Create(&module_def);
}
