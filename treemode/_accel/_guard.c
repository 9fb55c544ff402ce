/* treemode's optional compiled extension (imported only by treemode/_accel/_compiled.py).
 *
 * One module, six files (their jobs: _guard.h): this one defines the module,
 * its configuration and `configure`.
 *
 * Kernels, each with a Python twin bound to it by tests/test_twins.py (the
 * guard `holds`/`version_tags`), and the
 * executor of the fast-path record the Python pipeline emits (`FastRecord`,
 * run by `FastCall`; every doubt goes back to Python through one callback, the
 * miss). Nothing here reads a private Flax or JAX name, nor an attribute of
 * treemode's objects by name: `configure` hands over, once and by keyword, what
 * treemode/_compat.py verified and the signal hold's objects; the record and
 * the cached flattenings (`Guarded`) are C structures. docs/contributing.md
 * describes both kinds.
 */
#include "_guard.h"

PyObject *tm_code_name;    /* interned "__code__" */
PyObject *tm_closure_name; /* interned "__closure__" */
PyObject *tm_dict_name;    /* interned "__dict__" */

/* The configuration (see `configure`), held. */
int tm_is_configured;
PyObject *tm_raw_value_member;   /* Variable._raw_value's member descriptor */
PyObject *tm_metadata_member;    /* Variable._var_metadata's member descriptor */
PyObject *tm_raw_value_name, *tm_metadata_name; /* their names (borrowed from them) */
PyObject *tm_trace_state;        /* its attribute `trace_attr`: the current trace's weakref */
PyObject *tm_trace_attr;
PyObject *tm_array_types;
PyObject *tm_closure_kinds, *tm_closure_ignore, *tm_closure_empty, *tm_closure_ignored;
PyObject *tm_hold_open, *tm_hold_deferred, *tm_hold_plan, *tm_signals, *tm_getsignal,
    *tm_setsignal;
PyObject *tm_typeof; /* jax.typeof: a record's signature check compares what it gives */
unsigned long tm_main_thread;
PyObject *tm_debug_checks; /* JAX's jax_debug_nans/infs states: a donated call misses under one */
PyObject *tm_value_name;   /* "value", the attribute of those states read */
PyObject *tm_shape_name;   /* "shape", compared before a signature's jax.typeof */

/* 0 (with a RuntimeError) until `configure` was called. */
int
tm_configured(void)
{
    if (tm_is_configured)
        return 1;
    PyErr_SetString(PyExc_RuntimeError,
                    "treemode._accel._guard: configure() was not called (import treemode first)");
    return 0;
}

int
tm_malformed(const char *message)
{
    PyErr_SetString(PyExc_TypeError, message);
    return -1;
}

/* configure(**fields): see treemode._accel._compiled.configure. */
static char *configure_fields[] = {TM_CONFIGURE_FIELD_NAMES, NULL};
#define CONFIGURE_OBJECTS TM_CONFIGURE_SIZE

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
    /* In CONFIGURE_FIELDS' order (the format's); a type where one is checked. */
    if (!PyArg_ParseTupleAndKeywords(
            args, kwds, "|$OOOO!O!O!OOOO!O!O!O!OOOO!O!:configure", configure_fields,
            &f[TM_CONFIGURE_RAW_VALUE], &f[TM_CONFIGURE_METADATA], &f[TM_CONFIGURE_TRACE_STATE],
            &PyUnicode_Type, &f[TM_CONFIGURE_TRACE_ATTR],
            &PySet_Type, &f[TM_CONFIGURE_ARRAY_TYPES],
            &PyDict_Type, &f[TM_CONFIGURE_CLOSURE_KINDS],
            &f[TM_CONFIGURE_CLOSURE_IGNORE], &f[TM_CONFIGURE_CLOSURE_EMPTY],
            &f[TM_CONFIGURE_CLOSURE_IGNORED],
            list, &f[TM_CONFIGURE_HOLD_OPEN], list, &f[TM_CONFIGURE_HOLD_DEFERRED],
            list, &f[TM_CONFIGURE_HOLD_PLAN], &PyTuple_Type, &f[TM_CONFIGURE_SIGNALS],
            &f[TM_CONFIGURE_GETSIGNAL], &f[TM_CONFIGURE_SETSIGNAL], &f[TM_CONFIGURE_TYPEOF],
            &PyLong_Type, &f[TM_CONFIGURE_MAIN_THREAD],
            &PyTuple_Type, &f[TM_CONFIGURE_DEBUG_CHECKS]))
        return NULL;
    for (int i = 0; i < CONFIGURE_OBJECTS; i++) {
        if (f[i] == NULL)
            return PyErr_Format(PyExc_TypeError, "configure: missing %s", configure_fields[i]);
    }
    unsigned long main_thread = PyLong_AsUnsignedLong(f[TM_CONFIGURE_MAIN_THREAD]);
    if (PyErr_Occurred())
        return NULL;
    if (!object_slot_member(f[TM_CONFIGURE_RAW_VALUE]) ||
        !object_slot_member(f[TM_CONFIGURE_METADATA]) ||
        !PyCallable_Check(f[TM_CONFIGURE_GETSIGNAL]) ||
        !PyCallable_Check(f[TM_CONFIGURE_SETSIGNAL]) ||
        !PyCallable_Check(f[TM_CONFIGURE_TYPEOF])) {
        tm_malformed("configure: raw_value, metadata: object-slot member descriptors; "
                     "getsignal, setsignal, typeof: callables");
        return NULL;
    }
    /* The fields held as they are, in CONFIGURE_FIELDS' order (all but the last two). */
    PyObject **targets[CONFIGURE_OBJECTS - 2] = {
        &tm_raw_value_member, &tm_metadata_member, &tm_trace_state, &tm_trace_attr,
        &tm_array_types, &tm_closure_kinds, &tm_closure_ignore, &tm_closure_empty,
        &tm_closure_ignored, &tm_hold_open, &tm_hold_deferred, &tm_hold_plan, &tm_signals,
        &tm_getsignal, &tm_setsignal, &tm_typeof,
    };
    for (int i = 0; i < CONFIGURE_OBJECTS - 2; i++)
        Py_XSETREF(*targets[i], Py_NewRef(f[i]));
    if (tm_value_name == NULL && (tm_value_name = PyUnicode_InternFromString("value")) == NULL)
        return NULL;
    if (tm_shape_name == NULL && (tm_shape_name = PyUnicode_InternFromString("shape")) == NULL)
        return NULL;
    Py_XSETREF(tm_debug_checks, Py_NewRef(f[TM_CONFIGURE_DEBUG_CHECKS]));
    tm_raw_value_name = PyDescr_NAME(tm_raw_value_member);
    tm_metadata_name = PyDescr_NAME(tm_metadata_member);
    tm_main_thread = main_thread;
    /* The Variable slots may be other descriptors now. */
    tm_slot_caches_clear();
    tm_is_configured = 1;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"configure", (PyCFunction)(void (*)(void))configure, METH_VARARGS | METH_KEYWORDS,
     configure_doc},
    {NULL, NULL, 0, NULL},
};

int
tm_add_type(PyObject *module, const char *name, PyTypeObject *type)
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

int
tm_fields_traverse(PyObject **fields, int n, visitproc visit, void *arg)
{
    for (int i = 0; i < n; i++)
        Py_VISIT(fields[i]);
    return 0;
}

int
tm_fields_clear(PyObject **fields, int n)
{
    for (int i = 0; i < n; i++)
        Py_CLEAR(fields[i]);
    return 0;
}

/* Adds `attr`: a tuple of the names in `names` (NULL-terminated). */
int
tm_add_names(PyObject *module, const char *attr, char **names)
{
    int first = 0;
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
    if (intern_once(&tm_code_name, "__code__") == NULL ||
        intern_once(&tm_closure_name, "__closure__") == NULL ||
        intern_once(&tm_dict_name, "__dict__") == NULL)
        return -1;
    if (tm_kernels_exec(module) < 0 || tm_record_exec(module) < 0 ||
        tm_executor_exec(module) < 0 ||
        tm_add_names(module, "CONFIGURE_FIELDS", configure_fields) < 0)
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
