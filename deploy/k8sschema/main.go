// Command k8sschema writes the JSON schemas kubeconform validates
// manifests against, from Kubernetes' own OpenAPI document (the
// swagger.json of the k8s.io/kubernetes module, api/openapi-spec) and from
// CustomResourceDefinitions (cert-manager's), so that validation needs no
// download beyond Go modules (deploy/validate.sh):
//
//	k8sschema -out DIR -swagger swagger.json -crd crd.yaml…
//
// One file per kind and version, DIR/<group>/<kind>_<version>.json (the
// core group is "v1"), which kubeconform finds with
// -schema-location 'DIR/{{ .Group }}/{{ .ResourceKind }}_{{ .ResourceAPIVersion }}.json'.
// Each schema is standalone (references inlined) and strict: an object
// with declared properties admits no others, so a misspelt field fails,
// as the API server's strict field validation would. Two types are
// widened as the API server reads them: int-or-string, and quantities
// (a number or a string).
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"sigs.k8s.io/yaml"
)

func main() {
	out := flag.String("out", "", "output `dir`ectory")
	swagger := flag.String("swagger", "", "Kubernetes' OpenAPI v2 `file` (api/openapi-spec/swagger.json)")
	var crds []string
	flag.Func("crd", "a CustomResourceDefinition YAML `file` (repeatable)", func(s string) error { crds = append(crds, s); return nil })
	flag.Parse()
	if *out == "" || (*swagger == "" && len(crds) == 0) {
		fmt.Fprintln(os.Stderr, "k8sschema: want -out and -swagger or -crd")
		os.Exit(2)
	}
	n := 0
	if *swagger != "" {
		k, err := fromSwagger(*swagger, *out)
		if err != nil {
			fmt.Fprintln(os.Stderr, "k8sschema:", err)
			os.Exit(1)
		}
		n += k
	}
	for _, f := range crds {
		k, err := fromCRD(f, *out)
		if err != nil {
			fmt.Fprintln(os.Stderr, "k8sschema:", err)
			os.Exit(1)
		}
		n += k
	}
	fmt.Printf("k8sschema: %d schemas in %s\n", n, *out)
}

type gvk struct{ Group, Version, Kind string }

func (g gvk) path(dir string) string {
	group := g.Group
	if group == "" {
		group = g.Version
	}
	return filepath.Join(dir, group, strings.ToLower(g.Kind)+"_"+g.Version+".json")
}

func write(path string, schema map[string]any) error {
	schema["$schema"] = "http://json-schema.org/schema#"
	b, err := json.Marshal(schema)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	return os.WriteFile(path, b, 0o644)
}

// fromSwagger writes a schema for every kind of Kubernetes' OpenAPI v2
// document.
func fromSwagger(file, dir string) (int, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return 0, err
	}
	var doc struct {
		Definitions map[string]map[string]any `json:"definitions"`
	}
	if err := json.Unmarshal(b, &doc); err != nil {
		return 0, fmt.Errorf("%s: %v", file, err)
	}
	n := 0
	for name, def := range doc.Definitions {
		kinds, _ := def["x-kubernetes-group-version-kind"].([]any)
		for _, k := range kinds {
			m, _ := k.(map[string]any)
			g := gvk{str(m["group"]), str(m["version"]), str(m["kind"])}
			if g.Kind == "" || g.Version == "" {
				continue
			}
			r := resolver{defs: doc.Definitions, open: map[string]bool{}}
			s := r.schema(map[string]any{"$ref": "#/definitions/" + name})
			if err := write(g.path(dir), s.(map[string]any)); err != nil {
				return n, err
			}
			n++
		}
	}
	return n, nil
}

func str(v any) string { s, _ := v.(string); return s }

// resolver inlines the references of swagger definitions.
type resolver struct {
	defs map[string]map[string]any
	open map[string]bool // definitions being inlined: a cycle becomes {}
}

func (r resolver) schema(v any) any {
	switch x := v.(type) {
	case map[string]any:
		if ref, ok := x["$ref"].(string); ok {
			name := strings.TrimPrefix(ref, "#/definitions/")
			switch {
			case name == "io.k8s.apimachinery.pkg.api.resource.Quantity":
				return map[string]any{"oneOf": []any{map[string]any{"type": "string"}, map[string]any{"type": "number"}}}
			case r.open[name] || r.defs[name] == nil:
				return map[string]any{}
			}
			r.open[name] = true
			s := r.schema(r.defs[name])
			delete(r.open, name)
			return s
		}
		return r.object(x, r.schema)
	case []any:
		out := make([]any, len(x))
		for i, e := range x {
			out[i] = r.schema(e)
		}
		return out
	}
	return v
}

// object copies a schema object, making it strict and widening
// int-or-string; sub is applied to every sub-schema.
func (resolver) object(x map[string]any, sub func(any) any) map[string]any {
	out := map[string]any{}
	for k, v := range x {
		switch k {
		case "properties", "patternProperties", "definitions":
			props := map[string]any{}
			for name, p := range v.(map[string]any) {
				props[name] = sub(p)
			}
			out[k] = props
		case "items", "additionalProperties", "not", "allOf", "anyOf", "oneOf":
			out[k] = sub(v)
		case "format", "x-kubernetes-group-version-kind", "description":
			// Formats are not checked (int32, byte…); descriptions are long.
		default:
			out[k] = v
		}
	}
	if x["format"] == "int-or-string" || x["x-kubernetes-int-or-string"] == true {
		return map[string]any{"oneOf": []any{map[string]any{"type": "string"}, map[string]any{"type": "integer"}}}
	}
	if _, ok := out["properties"]; ok && x["additionalProperties"] == nil && x["x-kubernetes-preserve-unknown-fields"] != true {
		out["additionalProperties"] = false
	}
	return out
}

// fromCRD writes a schema for every served version of a
// CustomResourceDefinition.
func fromCRD(file, dir string) (int, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return 0, err
	}
	j, err := yaml.YAMLToJSON(b)
	if err != nil {
		return 0, fmt.Errorf("%s: %v", file, err)
	}
	var crd struct {
		Kind string `json:"kind"`
		Spec struct {
			Group string `json:"group"`
			Names struct {
				Kind string `json:"kind"`
			} `json:"names"`
			Versions []struct {
				Name   string `json:"name"`
				Served bool   `json:"served"`
				Schema struct {
					OpenAPIV3Schema map[string]any `json:"openAPIV3Schema"`
				} `json:"schema"`
			} `json:"versions"`
		} `json:"spec"`
	}
	if err := json.Unmarshal(j, &crd); err != nil || crd.Kind != "CustomResourceDefinition" {
		return 0, fmt.Errorf("%s: not a CustomResourceDefinition (%v)", file, err)
	}
	n := 0
	for _, v := range crd.Spec.Versions {
		if !v.Served || v.Schema.OpenAPIV3Schema == nil {
			continue
		}
		var walk func(any) any
		r := resolver{}
		walk = func(v any) any {
			switch x := v.(type) {
			case map[string]any:
				o := r.object(x, walk)
				if x["nullable"] == true {
					if t, ok := o["type"].(string); ok {
						o["type"] = []any{t, "null"}
					}
				}
				return o
			case []any:
				out := make([]any, len(x))
				for i, e := range x {
					out[i] = walk(e)
				}
				return out
			}
			return v
		}
		s := walk(v.Schema.OpenAPIV3Schema).(map[string]any)
		if err := write(gvk{crd.Spec.Group, v.Name, crd.Spec.Names.Kind}.path(dir), s); err != nil {
			return n, err
		}
		n++
	}
	return n, nil
}
