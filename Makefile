# lily: `make run` (install, build, write the demo model, serve it) and `make test` (install, build, test).
BUILD ?= build
JOBS ?= $(shell nproc)
DEMO := models/tiny
# MODEL: a checkpoint directory or a Hugging Face id (ORG/NAME, found in the hub cache; `lily pull` fetches it).
MODEL ?= $(DEMO)
PORT ?= 8080

.PHONY: deps build test run clean

deps:
	@bash scripts/install_deps.sh

build: deps
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release >/dev/null
	@cmake --build $(BUILD) -j $(JOBS)

$(DEMO)/config.json: | build
	./$(BUILD)/lily synth --preset tiny --layout mlx --out $(DEMO)

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)
	@bash scripts/run_python_tests.sh $(BUILD)

run: build $(if $(filter $(DEMO),$(MODEL)),$(DEMO)/config.json)
	./$(BUILD)/lily serve --model $(MODEL) --port $(PORT)

clean:
	rm -rf $(BUILD)
