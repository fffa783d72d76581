#!/bin/bash
cd /work/main && . .venv/bin/activate
common="-m smollm2-135m --source chat --seq-len 128 --threads 1 --work-dir OUT/work --resume --json --target-agreement 0.95"
for cfg in "p0:--patience 0" "p3:--patience 3" "c:--patience 0 --compensation auto" "p3c:--patience 3 --compensation auto"; do
  name=${cfg%%:*}; args=${cfg#*:}
  echo "== $name $args $(date)" >> OUT/run.log
  laserlm calibrate $common $args -o OUT/t95_$name.laser.safetensors > OUT/t95_$name.json 2> OUT/t95_$name.err
  echo "rc=$? $(date)" >> OUT/run.log
done
#!/bin/bash
cd /work/main && . .venv/bin/activate
common="-m smollm2-135m --source chat --seq-len 128 --threads 1 --work-dir OUT/work --resume --json"
for cfg in "t95_c2:--target-agreement 0.95 --compensation auto" "t90_p0:--target-agreement 0.90" "t90_p3:--target-agreement 0.90 --patience 3" "t90_c:--target-agreement 0.90 --compensation auto"; do
  name=${cfg%%:*}; args=${cfg#*:}
  echo "== $name $args $(date)" >> OUT/run.log
  laserlm calibrate $common $args -o OUT/$name.laser.safetensors > OUT/$name.json 2> OUT/$name.err
  echo "rc=$? $(date)" >> OUT/run.log
done
# first: laserlm calibrate -m smollm2-135m --source chat --seq-len 128 --threads 1 -o OUT/p0.laser.safetensors --work-dir OUT/work (trains the modules; the runs above resume from it)
