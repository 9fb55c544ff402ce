/* The executor of the fast-path record (declarations: _guard.h).
 *
 * After a call, the Python pipeline (treemode._pipeline._callsite.fast_record)
 * emits a `FastRecord`, or None where a fast path cannot be trusted; a
 * `FastCall` (the base of treemode.jit's wrapper) executes it: match the
 * arguments against the record's slots (the cached flattenings, `Guarded`)
 * and the closure's objects, call the compiled entry, write the new values
 * back (`tm_write_back`, _guard_write.c). Every doubt is a miss, handed to the
 * one Python callback.
 */
#include "_guard.h"

/* Appends `var`'s `_raw_value` to `out`: 1, 0 if it has none, -1 on error. */
static int
gather_raw_value(PyObject *out, PyObject *var)
{
    Py_ssize_t offset = tm_raw_value_offset(Py_TYPE(var));
    if (offset >= 0) {
        PyObject *value = *(PyObject **)((char *)var + offset); /* borrowed; NULL if unset */
        return value == NULL ? 0 : (PyList_Append(out, value) < 0 ? -1 : 1);
    }
    PyObject *value = PyObject_GetAttr(var, tm_raw_value_name);
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
    static char *names[] = {TM_GUARDED_FIELD_NAMES, NULL};
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

#define GUARDED_OBJECTS TM_GUARDED_SIZE /* arg, state, variables, flat, in this order */

static int
guarded_traverse(GuardedObject *self, visitproc visit, void *arg)
{
    return tm_fields_traverse(&self->arg, GUARDED_OBJECTS, visit, arg);
}

static int
guarded_clear(GuardedObject *self)
{
    return tm_fields_clear(&self->arg, GUARDED_OBJECTS);
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

/* Whether `obj`, passed where the record saw a bare array, is one (`jax.jit`'s
 * rule: an array of a known type, or a Python number): 1, 0, or -1. */
static int
bare_array(PyObject *obj)
{
    if (PyFloat_CheckExact(obj) || PyLong_CheckExact(obj) || PyBool_Check(obj) ||
        PyComplex_CheckExact(obj))
        return 1;
    return PySet_Contains(tm_array_types, (PyObject *)Py_TYPE(obj));
}

/* A Guarded against the object passed: 1 matched (its Variables' values
 * appended to `dynamic`, the Variables to `variables`), 0 not (also where a
 * value is no longer an array of a known type: a Python number, or a layout
 * change), -1 error. */
static int
match_guarded(GuardedObject *g, PyObject *obj, PyObject *dynamic, PyObject *variables)
{
    PyObject *arg = tm_referent(g->arg);
    Py_XDECREF(arg); /* only compared */
    if (arg != obj)
        return 0;
    int result = tm_state_holds(g->state, g->variables, obj);
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
        int known = PySet_Contains(tm_array_types, (PyObject *)type);
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
    PyObject *held_obj = tm_referent(slot); /* the record checked: a weak reference */
    if (held_obj == NULL)
        return 0; /* the flattening was dropped */
    int result = Py_IS_TYPE(held_obj, &Guarded_Type)
                     ? match_guarded((GuardedObject *)held_obj, obj, dynamic, variables)
                     : 0;
    Py_DECREF(held_obj);
    return result;
}

/* ---- The executor of the fast-path record (`FastRecord`: _guard_record.c) ----
 *
 * After a call, the Python pipeline (treemode._pipeline._callsite.fast_record)
 * emits a `FastRecord`, or None where a fast path cannot be trusted; a
 * `FastCall` (the base of treemode.jit's wrapper) executes it: match the
 * arguments and the closure's objects, call the compiled entry, write the new
 * values. Every doubt (a mismatch, a shared donated buffer, a trace JAX must
 * make, an unusual signal-hold state, other keyword names) is a miss, handed to
 * the one Python callback, `miss(self, error, args, kwargs)`: `error` is None, or
 * the exception the compiled entry raised. */

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

/* 1 while one of JAX's NaN/Inf checks (`debug_checks`) is on, 0 otherwise, -1 with
 * an exception: under one, a donated call runs undonated in the pipeline (JAX's
 * re-run that names the primitive needs the inputs alive). */
static int
debug_check_on(void)
{
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(tm_debug_checks); i++) {
        PyObject *value = PyObject_GetAttr(PyTuple_GET_ITEM(tm_debug_checks, i), tm_value_name);
        if (value == NULL)
            return -1;
        int on = PyObject_IsTrue(value);
        Py_DECREF(value);
        if (on != 0)
            return on;
    }
    return 0;
}

/* Whether `array` has a shape and `aval` (a jax.typeof) another one: 1, else 0
 * (no exception; 0 where either has none, and jax.typeof decides). */
static int
shapes_differ(PyObject *array, PyObject *aval)
{
    PyObject *shape = PyObject_GetAttr(array, tm_shape_name);
    PyObject *expected = shape == NULL ? NULL : PyObject_GetAttr(aval, tm_shape_name);
    int same = expected == NULL ? -1 : PyObject_RichCompareBool(shape, expected, Py_EQ);
    Py_XDECREF(shape);
    Py_XDECREF(expected);
    if (same < 0)
        PyErr_Clear();
    return same == 0;
}

/* Executes `r` on `args`: the call's output; or NULL with `*error` set to the
 * exception the compiled entry raised (the miss explains it); or NULL with an
 * exception set (raised as it is: a failed write, undone, or finished after a
 * donated call); or NULL without either: a miss. */
static PyObject *
execute(tm_record *r, PyObject *args, PyObject *kwargs, PyObject **error)
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
    PyObject *trace = PyObject_GetAttr(tm_trace_state, tm_trace_attr);
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
    if (tm_closure_reads_hold(r->closure_reads) != 1)
        goto done;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(r->closure_holders); i++) {
        PyObject *obj = tm_held(PyTuple_GET_ITEM(r->closure_holders, i));
        if (obj == NULL)
            goto done; /* the object died */
        ok = match_one(PyTuple_GET_ITEM(r->lifted_slots, i), obj, dynamic, variables);
        Py_DECREF(obj);
        if (ok != 1)
            goto done;
    }
    /* The signature: where an entry's signatures write different sets, the arrays
     * that tell them apart must have the record's abstract values. Their shapes
     * first: a cheap answer for the record of another signature. */
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(r->checked); i++) {
        Py_ssize_t at = PyLong_AsSsize_t(PyTuple_GET_ITEM(r->checked, i));
        if (at < 0 || at >= PyList_GET_SIZE(dynamic)) {
            PyErr_Clear();
            goto done;
        }
        if (shapes_differ(PyList_GET_ITEM(dynamic, at), PyTuple_GET_ITEM(r->avals, i)))
            goto done;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(r->checked); i++) {
        Py_ssize_t at = PyLong_AsSsize_t(PyTuple_GET_ITEM(r->checked, i));
        PyObject *aval = PyObject_CallOneArg(tm_typeof, PyList_GET_ITEM(dynamic, at));
        if (aval == NULL) {
            PyErr_Clear(); /* a miss: the pipeline decides */
            goto done;
        }
        ok = PyObject_RichCompareBool(aval, PyTuple_GET_ITEM(r->avals, i), Py_EQ);
        Py_DECREF(aval);
        if (ok != 1) {
            PyErr_Clear();
            goto done;
        }
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
        token = tm_hold_signals(split[0]);
        if (token == NULL)
            goto done;
        result = PyObject_Vectorcall(r->jitted, split, 2, NULL);
    }
    if (result == NULL) {
        *error = tm_fetch_error();
        goto done;
    }
    if (!PyTuple_Check(result) || PyTuple_GET_SIZE(result) != TM_ENTRY_SIZE) {
        PyErr_SetString(PyExc_SystemError, "treemode: a compiled entry returns (out, updates)");
        goto done;
    }
    PyObject *updates = PyTuple_GET_ITEM(result, TM_ENTRY_UPDATES);
    if (updates != Py_None) { /* None: the trace updates nothing */
        if (!PyTuple_Check(updates) || PyTuple_GET_SIZE(updates) != PyList_GET_SIZE(variables)) {
            PyErr_SetString(PyExc_SystemError,
                            "treemode: a compiled entry's updates differ from its record's Variables");
            goto done;
        }
        if (tm_write_back(variables, updates) < 0) {
            if (r->donated != Py_None)
                tm_finish_write(variables, updates);
            goto done;
        }
    }
    out = Py_NewRef(PyTuple_GET_ITEM(result, TM_ENTRY_OUT));
done:
    if (token != NULL && tm_release_signals(token) < 0) {
        Py_CLEAR(out); /* a held signal's exception, raised after the write */
        if (*error != NULL) {
            tm_chain(*error);
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
 * (a list of FastRecords, the most recently made first, at most
 * TM_RECORDS_BOUND; the executor's table, shared by the wrappers of one
 * function), and go to `_miss(self, error, args, kwargs)` otherwise (`_miss` is a
 * function, not a bound method: no reference cycle). A record that does not
 * match passes the call to the next one; a record that matched and whose
 * compiled entry raised hands the error to the miss. The miss returns `(out,
 * record)`: the executor adds the record (unless None) to its table, first, in
 * place of the one with an equal key, and returns `out`. */
typedef struct {
    PyObject_HEAD
    PyObject *records;
    PyObject *miss;
    PyObject *before_call; /* None, or (target, name): target.name = None first */
} FastCallObject;

#define FAST_CALL_OBJECTS 3 /* records, miss, before_call, in this order */

/* Sets `target.name = None` where `before_call` is (target, name): 0, or -1. */
static int
run_before_call(PyObject *before_call)
{
    if (before_call == NULL || !PyTuple_Check(before_call) || PyTuple_GET_SIZE(before_call) != 2)
        return 0;
    return PyObject_SetAttr(PyTuple_GET_ITEM(before_call, 0), PyTuple_GET_ITEM(before_call, 1),
                            Py_None);
}

/* Adds `record` to the table `records` (a list): first, without the record of an
 * equal key, at most TM_RECORDS_BOUND. */
static int
table_add(PyObject *records, PyObject *record)
{
    PyObject *key = ((tm_record *)record)->key;
    for (Py_ssize_t i = PyList_GET_SIZE(records) - 1; i >= 0; i--) {
        if (i >= PyList_GET_SIZE(records))
            continue; /* a comparison ran Python code that shortened the table */
        PyObject *old = Py_NewRef(PyList_GET_ITEM(records, i));
        int same = 0;
        if (Py_IS_TYPE(old, &tm_record_type))
            same = PyObject_RichCompareBool(((tm_record *)old)->key, key, Py_EQ);
        if (same > 0 && i < PyList_GET_SIZE(records) && PyList_GET_ITEM(records, i) == old)
            same = PySequence_DelItem(records, i) < 0 ? -1 : 1;
        Py_DECREF(old);
        if (same < 0)
            return -1;
    }
    if (PyList_Insert(records, 0, record) < 0)
        return -1;
    if (PyList_GET_SIZE(records) > TM_RECORDS_BOUND)
        return PyList_SetSlice(records, TM_RECORDS_BOUND, PyList_GET_SIZE(records), NULL);
    return 0;
}

static PyObject *
fast_call(PyObject *self, PyObject *args, PyObject *kwargs)
{
    FastCallObject *f = (FastCallObject *)self;
    PyObject *error = NULL;
    if (run_before_call(f->before_call) < 0)
        return NULL;
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs) == 0)
        kwargs = NULL; /* f(*args, **{}) */
    if (f->records != NULL && PyList_Check(f->records) && tm_is_configured) {
        PyObject *records = Py_NewRef(f->records);
        /* Each record held while it runs: a call inside it may change the table. */
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(records) && error == NULL; i++) {
            PyObject *record = Py_NewRef(PyList_GET_ITEM(records, i));
            PyObject *result = NULL;
            if (Py_IS_TYPE(record, &tm_record_type))
                result = execute((tm_record *)record, args, kwargs, &error);
            Py_DECREF(record);
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
    if (result == NULL)
        return NULL;
    if (!PyTuple_Check(result) || PyTuple_GET_SIZE(result) != TM_MISS_SIZE) {
        Py_DECREF(result);
        PyErr_SetString(PyExc_TypeError, "FastCall: the miss returns (out, record)");
        return NULL;
    }
    PyObject *out = Py_NewRef(PyTuple_GET_ITEM(result, TM_MISS_OUT));
    PyObject *record = PyTuple_GET_ITEM(result, TM_MISS_RECORD);
    if (Py_IS_TYPE(record, &tm_record_type) && f->records != NULL && PyList_Check(f->records)) {
        PyObject *records = Py_NewRef(f->records);
        int failed = table_add(records, record);
        Py_DECREF(records);
        if (failed < 0) {
            Py_DECREF(result);
            Py_DECREF(out);
            return NULL;
        }
    }
    Py_DECREF(result);
    return out;
}

static int
fast_call_traverse(FastCallObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    return tm_fields_traverse(&self->records, FAST_CALL_OBJECTS, visit, arg);
}

static int
fast_call_clear(FastCallObject *self)
{
    return tm_fields_clear(&self->records, FAST_CALL_OBJECTS);
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
     "the executor's table: a list of the FastRecords a call may execute, tried in "
     "order (anything else: every call misses)"},
    {"_miss", T_OBJECT, offsetof(FastCallObject, miss), 0,
     "miss(self, error, args, kwargs) -> (out, record): runs a call no record runs"},
    {"_before_call", T_OBJECT, offsetof(FastCallObject, before_call), 0,
     "None, or (target, name): every call first sets target.name = None"},
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


/* Adds the executor's types and the bound of its table. */
int
tm_executor_exec(PyObject *module)
{
    if (tm_add_type(module, "Guarded", &Guarded_Type) < 0 ||
        tm_add_type(module, "FastCall", &FastCall_Type) < 0 ||
        PyModule_AddIntConstant(module, "RECORDS_BOUND", TM_RECORDS_BOUND) < 0)
        return -1;
    return 0;
}
