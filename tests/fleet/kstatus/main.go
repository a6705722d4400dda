// Command kstatus prints what kstatus (sigs.k8s.io/cli-utils/pkg/kstatus/status), the status
// library of kpt, Config Sync, Flux's health checks and `kubectl wait`-style tools, computes for
// Kubernetes objects.
//
// Input on stdin: a JSON array of objects, or a List (`kubectl get -o json`: {"items": [...]}).
// Output: one JSON line per object, in order: {"name": ..., "status": ..., "message": ...},
// where status is InProgress, Current, Failed, Terminating or Unknown. A malformed object
// fails the whole run (exit 1, reason on stderr): a test must never read a half answer.
//
// The tests (tests/fleet/kstatus.py) build it once per content of this folder and cache it.
package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"os"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	utiljson "k8s.io/apimachinery/pkg/util/json"
	"sigs.k8s.io/cli-utils/pkg/kstatus/status"
)

type line struct {
	Name    string `json:"name"`
	Status  string `json:"status"`
	Message string `json:"message"`
}

// objects decodes stdin the way the API machinery does (utiljson: whole numbers as int64, which
// the status rules' NestedInt64 lookups need; encoding/json would give float64).
func objects(raw []byte) ([]interface{}, error) {
	var doc interface{}
	if err := utiljson.Unmarshal(raw, &doc); err != nil {
		return nil, fmt.Errorf("stdin is not JSON: %w", err)
	}
	switch v := doc.(type) {
	case []interface{}:
		return v, nil
	case map[string]interface{}:
		if items, ok := v["items"].([]interface{}); ok {
			return items, nil
		}
	}
	return nil, fmt.Errorf("stdin is neither a JSON array nor a List of objects")
}

func run(in io.Reader, out io.Writer) error {
	raw, err := io.ReadAll(in)
	if err != nil {
		return err
	}
	objs, err := objects(raw)
	if err != nil {
		return err
	}
	w := bufio.NewWriter(out)
	enc := json.NewEncoder(w)
	for i, item := range objs {
		obj, ok := item.(map[string]interface{})
		if !ok {
			return fmt.Errorf("object %d is not a JSON object", i)
		}
		u := &unstructured.Unstructured{Object: obj}
		res, err := status.Compute(u)
		if err != nil {
			return fmt.Errorf("object %d (%q): %w", i, u.GetName(), err)
		}
		if err := enc.Encode(line{u.GetName(), res.Status.String(), res.Message}); err != nil {
			return err
		}
	}
	return w.Flush()
}

func main() {
	if err := run(os.Stdin, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "kstatus:", err)
		os.Exit(1)
	}
}
