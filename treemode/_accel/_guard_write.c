/* The write-back of the compiled executor (declarations: _guard.h).
 *
 * After a call the executor (_guard_executor.c) stores the new values in the
 * Variables, all or nothing (`tm_write_back`); after a donated call, whose old
 * buffers the executable consumed, a failed write is finished instead
 * (`tm_finish_write`). Their Python twins
 * are treemode._pipeline._writeback.write_back and finish_write;
 * tests/test_twins.py binds them through executed calls.
 */
#include "_guard.h"

/* Sets `var._raw_value` to `value` (a new reference is taken) and appends
 * the previous value to `previous` (which keeps it alive until every write is
 * done). -1 with an exception on failure, with nothing written. */
static int
set_raw_value(PyObject *var, PyObject *value, PyObject *previous)
{
    Py_ssize_t offset = tm_raw_value_offset(Py_TYPE(var));
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
    PyObject *old = PyObject_GetAttr(var, tm_raw_value_name);
    if (old == NULL)
        return -1;
    int appended = PyList_Append(previous, old);
    Py_DECREF(old);
    if (appended < 0)
        return -1;
    if (PyObject_GenericSetAttr(var, tm_raw_value_name, value) < 0) {
        /* keep `previous` aligned with the writes made */
        PyList_SetSlice(previous, PyList_GET_SIZE(previous) - 1, PyList_GET_SIZE(previous), NULL);
        return -1;
    }
    return 0;
}

/* Writes every non-None `updates[i]` into `variables[i]` (both fast
 * sequences of one length), all or nothing: the count written, or -1. */
Py_ssize_t
tm_write_back(PyObject *variables, PyObject *updates)
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

/* After a donated call a failed write cannot be undone (the old buffers were
 * consumed): it is finished instead, each new value stored in its Variable's
 * value slot (a Variable whose own setter refused included); the exception
 * raised stays the one raised. */
void
tm_finish_write(PyObject *variables, PyObject *updates)
{
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    descrsetfunc set = Py_TYPE(tm_raw_value_member)->tp_descr_set;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(variables); i++) {
        PyObject *update = PyTuple_GET_ITEM(updates, i);
        if (update != Py_None && set(tm_raw_value_member, PyList_GET_ITEM(variables, i), update) < 0)
            PyErr_Clear();
    }
    PyErr_Restore(type, value, traceback);
}
