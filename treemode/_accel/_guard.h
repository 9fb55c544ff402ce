/* The private declarations shared by the C files of treemode's extension
 * (one module, treemode._accel._guard; setup.py lists the files):
 *
 *   _guard.c           the module: `configure` (the configuration below) and its init;
 *   _guard_kernels.c   the guard (`holds`, the dict version tags), the closure-read check;
 *   _guard_record.c    the fast-path record (`FastRecord`): its type, constructor, members;
 *   _guard_executor.c  the executor of the fast-path record (`Guarded`, `FastCall`, the
 *                      table) and its matching;
 *   _guard_write.c     the executor's write-back, all or nothing, and its finish;
 *   _guard_hold.c      the signal hold of a donated call and the exception plumbing.
 *
 * Names shared between the files start with `tm_`; everything else is static.
 */
#ifndef TREEMODE_GUARD_H
#define TREEMODE_GUARD_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h> /* T_OBJECT_EX */

#include "_border.h" /* the structures read from Python (generated) */

/* The shared names are the module's own: hidden, so that calls between the files
 * bind directly instead of through the dynamic symbol table (only PyInit__guard,
 * declared with PyMODINIT_FUNC, is exported). */
#if defined(__GNUC__) && !defined(_WIN32)
#pragma GCC visibility push(hidden)
#endif

/* Interned attribute names (set by the module's init). */
extern PyObject *tm_code_name;    /* "__code__" */
extern PyObject *tm_closure_name; /* "__closure__" */
extern PyObject *tm_dict_name;    /* "__dict__" */

/* The configuration (see `configure` in _guard.c), held. */
extern int tm_is_configured;
extern PyObject *tm_raw_value_member; /* Variable._raw_value's member descriptor */
extern PyObject *tm_metadata_member;  /* Variable._var_metadata's member descriptor */
extern PyObject *tm_raw_value_name, *tm_metadata_name; /* their names (borrowed from them) */
extern PyObject *tm_trace_state; /* its attribute `tm_trace_attr`: the current trace's weakref */
extern PyObject *tm_trace_attr;
extern PyObject *tm_array_types;
extern PyObject *tm_closure_kinds, *tm_closure_ignore, *tm_closure_empty, *tm_closure_ignored;
extern PyObject *tm_hold_open, *tm_hold_deferred, *tm_hold_plan, *tm_signals, *tm_getsignal,
    *tm_setsignal;
extern PyObject *tm_typeof; /* jax.typeof, for a record's signature check */
extern unsigned long tm_main_thread;
extern PyObject *tm_debug_checks; /* JAX's jax_debug_nans/infs states */
extern PyObject *tm_value_name;   /* "value", the attribute of those states read */
extern PyObject *tm_shape_name;   /* "shape", compared before a signature's jax.typeof */

/* _guard.c */
int tm_configured(void);
int tm_malformed(const char *message);
int tm_add_type(PyObject *module, const char *name, PyTypeObject *type);
int tm_add_names(PyObject *module, const char *attr, char **names);
/* The C types (`Guarded`, `FastRecord`, `FastCall`) keep their objects in
 * consecutive fields: one traverse and one clear serve them all. */
int tm_fields_traverse(PyObject **fields, int n, visitproc visit, void *arg);
int tm_fields_clear(PyObject **fields, int n);

/* _guard_kernels.c */
int tm_kernels_exec(PyObject *module);
int tm_state_holds(PyObject *state, PyObject *variables, PyObject *top);
PyObject *tm_referent(PyObject *ref);
PyObject *tm_held(PyObject *holder);
int tm_closure_reads_hold(PyObject *reads);
Py_ssize_t tm_raw_value_offset(PyTypeObject *type);
void tm_slot_caches_clear(void);

/* _guard_record.c: the fast-path record, `FastRecord` (its fields in the
 * order of `RECORD_FIELDS`, after `version`), read by the executor. */
typedef struct {
    PyObject_HEAD
    PyObject *key, *slots, *partial_args, *kw_names, *closure_reads, *closure_holders,
        *lifted_slots, *jitted, *donated, *kept, *trace, *checked, *avals;
} tm_record;
extern PyTypeObject tm_record_type;
int tm_record_exec(PyObject *module);

/* _guard_executor.c */
int tm_executor_exec(PyObject *module);

/* _guard_write.c */
Py_ssize_t tm_write_back(PyObject *variables, PyObject *updates);
void tm_finish_write(PyObject *variables, PyObject *updates);

/* _guard_hold.c */
PyObject *tm_hold_signals(PyObject *donated);
int tm_release_signals(PyObject *token);
PyObject *tm_fetch_error(void);
void tm_restore_error(PyObject *error);
void tm_chain(PyObject *context);

#if defined(__GNUC__) && !defined(_WIN32)
#pragma GCC visibility pop
#endif

#endif /* TREEMODE_GUARD_H */
